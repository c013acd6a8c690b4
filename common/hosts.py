"""The one reading of a URL's host that every part of the crawler uses.

The splitter's validation, the SSRF guard, robots.txt's origin, the per-host
cap and the image client's connect each used to read the host their own way
(``urlsplit`` here, yarl's IDNA there). They disagreed: ``http://🯱🯲🯷.0.0.1/``
was an unresolvable name to the guard and ``127.0.0.1`` to yarl, so the guard
let through what the client then connected to. Now each of them asks
``url_origin`` and judges or connects to the same host.

A host normalises to plain ASCII: lower-case LDH labels (IDNA 2008 / UTS 46,
as yarl and browsers encode them), a dotted-quad IPv4 address or a compressed
IPv6 address. Numeric IPv4 spellings that some layer would turn into an
address (``2130706433``, ``0177.0.0.1``, ``0x7f.1``, ``127.1``: the WHATWG
URL standard and ``inet_aton`` agree on these) normalise to that address.
Anything else (zone ids, percent-encoding, labels IDNA refuses, a host that
yarl would read differently) is refused with ``InvalidHost``.
"""
from __future__ import annotations

import ipaddress
import re
from functools import lru_cache
from typing import NamedTuple
from urllib.parse import urlsplit

import idna
from yarl import URL

DEFAULT_PORTS = {"http": 80, "https": 443}
_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")  # LDH, and _ as real hosts use it
_DECIMAL = re.compile(r"[0-9]+")
_HEX = re.compile(r"0[xX][0-9a-fA-F]*")
# Default-ignorable code points UTS 46 deletes silently (``e\u200bvil.com`` is ``evil.com``):
# a host that needs them to look different from what it is, is refused.
_IGNORABLE = re.compile("[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u1806\u180b-\u180f"
                        "\u200b-\u200f\u202a-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff"
                        "\uffa0\ufff0-\ufff8\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
                        "\U000e0000-\U000e0fff]")


class InvalidHost(ValueError):
    """A host that does not normalise to ASCII labels or an IP address."""


class Origin(NamedTuple):
    scheme: str
    host: str   # normalised; an IPv6 address without brackets
    port: int

    @property
    def netloc(self) -> str:
        """host:port as written in a URL (IPv6 in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@lru_cache(maxsize=65536)  # every layer asks for each URL, and a crawl (or a URL list) repeats its hosts
def normalise_host(host: str) -> str:
    """The ASCII host a connection to ``host`` goes to; InvalidHost if there is none."""
    text = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if "%" in text:
        raise InvalidHost(f"host {host[:100]!r} has a zone id or percent-encoding")
    if ":" in text:
        try:
            return ipaddress.IPv6Address(text).compressed
        except ValueError:
            raise InvalidHost(f"host {host[:100]!r} is not an IPv6 address") from None
    if not text.isascii():
        if _IGNORABLE.search(text):
            raise InvalidHost(f"host {host[:100]!r} contains invisible characters")
        try:
            text = idna.encode(text, uts46=True).decode("ascii")
        except (idna.IDNAError, UnicodeError) as exc:
            raise InvalidHost(f"host {host[:100]!r} is not a valid IDNA name: {exc}") from None
    text = text.lower()
    text = text[:-1] if text.endswith(".") else text
    labels = text.split(".")
    if _DECIMAL.fullmatch(labels[-1]) or _HEX.fullmatch(labels[-1]):
        return _ipv4(labels, host)
    if len(text) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise InvalidHost(f"host {host[:100]!r} is not made of letters, digits and hyphens")
    return text


def _ipv4(parts: list[str], host: str) -> str:
    """WHATWG's IPv4 parser: 1 to 4 parts, each decimal, octal (0...) or hex (0x...),
    the last filling the remaining bytes. A host ending in a number that is not an
    address is refused, as browsers refuse it."""
    if len(parts) > 4:
        raise InvalidHost(f"host {host[:100]!r} ends in a number but is not an IPv4 address")
    numbers = []
    for part in parts:
        try:
            if _HEX.fullmatch(part):
                numbers.append(int(part[2:] or "0", 16))
            elif len(part) > 1 and part.startswith("0"):
                numbers.append(int(part, 8))
            else:
                numbers.append(int(part, 10))
        except ValueError:
            raise InvalidHost(f"host {host[:100]!r} is not an IPv4 address") from None
    *leading, last = numbers
    if any(n > 255 for n in leading) or last >= 256 ** (5 - len(numbers)):
        raise InvalidHost(f"host {host[:100]!r} is out of IPv4 range")
    value = last + sum(n << (8 * (3 - i)) for i, n in enumerate(leading))
    return str(ipaddress.IPv4Address(value))


# The origins kept (url_origin): a few thousand URLs in flight, each of under 2,048 characters
# (an inbound URL is shorter: contracts' MAX_URL_LENGTH), so at most a few MB.
ORIGIN_CACHE_URLS, ORIGIN_CACHE_MAX_URL_CHARS = 4096, 2048


def url_origin(url: str) -> Origin:
    """Scheme, normalised host and port of an http(s) URL; InvalidHost if any is missing or bad.

    The host is read by both urllib and yarl (the parser our connections use) and the URL is
    refused unless both normalise to the same host, so no layer can read another host out of it.
    A worker asks this of each URL about eight times while fetching it (the validation, robots,
    the host cap, the guard, the connection pool): the last few thousand URLs' origins are
    kept, ~50 us of a worker's CPU a URL. A refusal is not kept: it is raised again.
    """
    if len(url) < ORIGIN_CACHE_MAX_URL_CHARS:
        return _cached_url_origin(url)
    return _url_origin(url)


def _url_origin(url: str) -> Origin:
    try:
        parts = urlsplit(url)
        port = parts.port
        target = URL(url)
    except ValueError as exc:
        raise InvalidHost(f"url does not parse: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise InvalidHost(f"url scheme must be http or https, not {parts.scheme[:20]!r}")
    if not parts.hostname or not target.raw_host:
        raise InvalidHost("url has no host")
    host = normalise_host(parts.hostname)
    if normalise_host(target.raw_host) != host or (port or DEFAULT_PORTS[scheme]) != target.port:
        raise InvalidHost(f"url {url[:100]!r} names its host ambiguously")
    return Origin(scheme, host, port or DEFAULT_PORTS[scheme])


_cached_url_origin = lru_cache(maxsize=ORIGIN_CACHE_URLS)(_url_origin)


def origin_cache_info() -> tuple[int, int, int | None, int]:
    """The origins kept by ``url_origin``: hits, misses, most held, held now."""
    info = _cached_url_origin.cache_info()
    return info.hits, info.misses, info.maxsize, info.currsize


def forget_origins() -> None:
    """``url_origin`` keeps no origin: the next ask of each URL is a miss."""
    _cached_url_origin.cache_clear()
