"""A site's machine-readable opt-outs beyond robots.txt's Allow and Disallow (README "Politeness").

Each is a pure function of what the site said: a response's headers (``ResponseConsent``, judged
before the body is read) and the AI-preference statements of robots.txt (``usage_refusal``).
A refusal is a ``Decision``: the signal and the value that decided it, for the URL's
``opted_out`` message (SPEC.md §1).

AI preferences: ``Content-Usage`` as draft-ietf-aipref-attach-05 attaches it (a response header,
and a robots.txt rule with an optional path) in the vocabulary of draft-ietf-aipref-vocab-07
(an RFC 9651 Dictionary whose keys are the categories ``train-ai`` and ``search``, value the token
``y`` or ``n``; anything else, an unknown key or a field that does not parse: unknown). Several
statements combine to the most restrictive (vocab section 5.1). The drafts still move:
docs/decisions.md "Consent" says what was read and when.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import http_sf

from common.contracts import (MAX_DECISION_VALUE, SIGNAL_CONTENT_USAGE_HEADER, SIGNAL_TDMREP_HEADER,
                              SIGNAL_X_ROBOTS_TAG)
from common.robots_tag import applicable_directives

AIPREF_VOCAB_DRAFT = "draft-ietf-aipref-vocab-07"
AIPREF_ATTACH_DRAFT = "draft-ietf-aipref-attach-05"
CONTENT_USAGE = "Content-Usage"
TDM_RESERVATION, TDM_POLICY = "tdm-reservation", "tdm-policy"
X_ROBOTS_TAG = "X-Robots-Tag"
# A Content-Usage value longer than this is not parsed (its preferences are unknown): no real
# statement is near it, and a structured-field parse of a hostile 64 KiB head costs the worker.
# X-Robots-Tag is split whole (cheap); tdm-reservation is compared whole.
MAX_HEADER_CHARS = 4096


@dataclass(frozen=True)
class Decision:
    """Why a URL is not crawled: the signal (``common.contracts.SIGNALS``) and what said so."""

    signal: str
    value: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", _printable(self.value)[:MAX_DECISION_VALUE])


def _printable(text: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in text[:MAX_DECISION_VALUE])


def _values(headers: Mapping[str, str], name: str) -> list[str]:
    getall = getattr(headers, "getall", None)
    if getall is not None:
        return [str(v) for v in getall(name, [])]
    value = headers.get(name)
    return [] if value is None else [value]


def usage_refusal(statement: str, categories: Iterable[str]) -> str | None:
    """The first of ``categories`` that ``statement`` (a Content-Usage value) disallows, or None.
    A statement that does not parse states nothing (vocab section 4.6)."""
    if len(statement) > MAX_HEADER_CHARS:
        return None
    try:
        parsed: Any = http_sf.parse(statement.encode("latin-1", "replace"), tltype="dictionary")
    except Exception:  # noqa: BLE001 - any malformed field, however it fails, is "unknown"
        return None
    if not isinstance(parsed, dict):
        return None
    for category in categories:
        item = parsed.get(category)
        if isinstance(item, tuple) and isinstance(item[0], http_sf.Token) and str(item[0]) == "n":
            return category
    return None


def combined_usage(statements: Iterable[str], categories: tuple[str, ...]) -> str | None:
    """The statement, of several (one per header line or robots.txt group), that disallows one of
    ``categories``: the most restrictive wins."""
    for statement in statements:
        if usage_refusal(statement, categories) is not None:
            return statement
    return None


@dataclass(frozen=True)
class ResponseConsent:
    """What a response's head says about crawling its body, judged before a byte of it is read.

    ``tokens``: our product token and ROBOTS_EXTRA_TOKENS (an X-Robots-Tag for any of them binds
    us); ``directives``: the X-Robots-Tag directives that opt out (X_ROBOTS_TAG_OPT_OUT)."""

    tokens: tuple[str, ...]
    directives: frozenset[str] = frozenset({"noai", "noimageai"})
    x_robots_tag: bool = True
    tdmrep: bool = True
    content_usage: bool = True
    categories: tuple[str, ...] = ("train-ai",)

    def refusal(self, headers: Mapping[str, str]) -> Decision | None:
        if self.tdmrep:
            decision = _tdm_header(headers)
            if decision is not None:
                return decision
        if self.x_robots_tag and self.directives:
            decision = self._x_robots_tag(headers)
            if decision is not None:
                return decision
        if self.content_usage and self.categories:
            refusing = combined_usage(_values(headers, CONTENT_USAGE), self.categories)
            if refusing is not None:
                return Decision(SIGNAL_CONTENT_USAGE_HEADER, refusing)
        return None

    def _x_robots_tag(self, headers: Mapping[str, str]) -> Decision | None:
        values = _values(headers, X_ROBOTS_TAG)  # read whole: the client bounds a head to 64 KiB
        if not values:
            return None
        for value in values:
            for token in self.tokens:
                found = [d for d in applicable_directives([value], token) if d in self.directives]
                if found:
                    return Decision(SIGNAL_X_ROBOTS_TAG, value.strip())
        return None


def _tdm_header(headers: Mapping[str, str]) -> Decision | None:
    """TDMRep section 3.2: ``tdm-reservation: 1`` reserves; any other value is a protocol error,
    read as unset. Several lines: the last one stands."""
    values = _values(headers, TDM_RESERVATION)
    if not values or values[-1].strip() != "1":
        return None
    policy = _values(headers, TDM_POLICY)
    value = "1" + (f" (policy {policy[-1].strip()[:200]})" if policy else "")
    return Decision(SIGNAL_TDMREP_HEADER, value)
