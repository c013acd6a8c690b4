"""One row of a URL list to its ``inbound_images`` message, validated as the splitter validates it.

The producer reports a bad row by file and row number; the splitter would only
be able to say ``rejected_messages`` with the message. So every rule of
SPEC.md §1 is checked here first, with the same functions.
"""
from __future__ import annotations

import hashlib
import re
import signal
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from json.encoder import encode_basestring_ascii as _json_string
from typing import Any

from common import contracts
from common.hosts import Origin
from common.process import die_with_parent
from url_lists.tsv_producer import with_scheme
from url_lists.sites import site_of_host


_URL_NAMESPACE = uuid.NAMESPACE_URL.bytes


# An origin written plainly: http or https, ASCII letters, digits, dots and hyphens, an optional
# port, then the path, query or fragment (or nothing). Both of url_origin's parsers (urllib
# and yarl) end such an authority at the same character and read nothing else into the
# host, so its origin is that of ``prefix + "/"``: read with url_origin once per prefix
# (a list repeats its hosts), not twice per URL, which was two thirds of a row's cost.
# Every other URL is read whole; the splitter reads every URL whole again regardless.
_PLAIN_ORIGIN = re.compile(r"https?://[A-Za-z0-9.-]+(?::[0-9]{1,5})?(?=[/?#]|\Z)", re.ASCII)


@lru_cache(maxsize=65536)
def _origin_of_prefix(prefix: str) -> Origin:
    return contracts.url_checked_origin(prefix + "/")


def url_origin_of(url: str) -> Origin:
    """``contracts.url_checked_origin(url)``, with a URL of a plainly written origin read per origin."""
    contracts.check_url_text(url)
    plain = _PLAIN_ORIGIN.match(url)
    if plain is None:
        return contracts.url_checked_origin(url)
    return _origin_of_prefix(plain.group())


def derived_identifier(url: str) -> str:
    """A stable identifier for a URL, ``uuid.uuid5(NAMESPACE_URL, url)`` (RFC 9562's name-based
    UUID): the same list produced twice gives the same identifiers. Written out rather than
    through ``uuid.UUID``, whose constructor was a fifth of a row's cost."""
    digest = bytearray(hashlib.sha1(_URL_NAMESPACE + url.encode()).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x50  # version 5
    digest[8] = (digest[8] & 0x3F) | 0x80  # RFC 4122 variant
    text = digest.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def _text(value: Any, what: str, numbers: bool = False) -> str:
    """A cell as text: strings, and integers where ``numbers`` (ids are often numbers in Parquet)."""
    if isinstance(value, str):
        return value.strip()
    if numbers and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if value is None:
        raise contracts.InvalidMessage(f"no {what}")
    raise contracts.InvalidMessage(f"{what} must be text, not {type(value).__name__}")


def row_message(url: Any, identifier: Any, source: Any, with_identifier: bool,
                with_source: bool) -> tuple[bytes, str]:
    """(the message, its source) for one row; InvalidMessage with the reason for a bad row.

    Without an identifier column the identifier comes from the URL; without a source
    column the source is the URL's site (``sites.site_of_host``).
    """
    text = _text(url, "url")
    if not text:
        raise contracts.InvalidMessage("no url")
    full = with_scheme(text)
    origin = url_origin_of(full)
    if with_identifier:
        name = contracts.validate_uuid(_text(identifier, "identifier", numbers=True))
    else:
        name = derived_identifier(full)
    site = contracts.validate_source(_text(source, "source")) if with_source else site_of_host(origin.host)
    # json.dumps of the same dict, without its per-call set-up (a tenth of a row's cost)
    message = f'{{"url": {_json_string(full)}, "uuid": {_json_string(name)}, "source": {_json_string(site)}}}'
    return message.encode(), site


@dataclass
class Converted:
    """One batch's rows as messages: ``rows[i]`` sends ``messages[i]`` to source ``sources[i]``;
    ``bad`` holds (row, reason) of the rows that are not crawlable."""

    rows: list[int] = field(default_factory=list)
    messages: list[bytes] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    bad: list[tuple[int, str]] = field(default_factory=list)


def convert_batch(values: list[tuple[Any, ...] | None], errors: dict[int, str], first_row: int,
                  with_identifier: bool, with_source: bool) -> Converted:
    """Every row of a batch (in a pool process: the URL parsers are most of a row's cost)."""
    out = Converted()
    for index, row_values in enumerate(values):
        row = first_row + index
        if row_values is None:
            reason = errors.get(index)
            if reason is not None:
                out.bad.append((row, reason))
            continue
        try:
            message, source = row_message(row_values[0], row_values[1], row_values[2], with_identifier, with_source)
        except contracts.InvalidMessage as exc:
            out.bad.append((row, str(exc)))
            continue
        out.rows.append(row)
        out.messages.append(message)
        out.sources.append(source)
    return out


def start_pool_process(producer_pid: int) -> None:
    """A pool process leaves Ctrl-C to the producer, which stops it in order, and dies with it
    when it is killed (SIGKILL, the OOM killer), so nothing of a killed producer runs on."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(producer_pid)
