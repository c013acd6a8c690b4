"""The X-Robots-Tag directives that apply to this crawler.

A header value is either ``noindex, nofollow`` (every crawler) or
``somebot: noindex`` (one crawler, named by its user-agent product token).
Directives that themselves contain a colon (``unavailable_after: <date>``,
``max-image-preview: large``) are told apart from a user-agent prefix by name.
"""
from __future__ import annotations

from collections.abc import Iterable

_DIRECTIVES_WITH_VALUES = {"unavailable_after", "max-snippet", "max-image-preview", "max-video-preview"}
NO_THUMBNAIL_DIRECTIVES = frozenset({"noindex", "noimageindex", "none"})


def applicable_directives(header_values: Iterable[str], token: str) -> list[str]:
    """Directives, lower-cased, from every X-Robots-Tag value meant for everyone or for
    ``token`` (the user-agent product token, matched case-insensitively)."""
    token = token.lower()
    found: list[str] = []
    for value in header_values:
        name, colon, rest = value.partition(":")
        if colon and name.strip().lower() not in _DIRECTIVES_WITH_VALUES and "," not in name:
            if name.strip().lower() != token:
                continue
            value = rest
        found.extend(part.strip().lower() for part in value.split(",") if part.strip())
    return found


def forbids_thumbnail(directives: Iterable[str]) -> bool:
    return any(directive in NO_THUMBNAIL_DIRECTIVES for directive in directives)
