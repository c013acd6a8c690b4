"""robots.txt-style path patterns (RFC 9309 section 2.2.3), which TDMRep's ``location`` and the
Content-Usage rules of robots.txt share: ``*`` is any run of characters, a final ``$`` the
end of the path, anything else a prefix of the path and query, compared byte for byte after
percent-encoded unreserved characters are decoded on both sides (``%7E`` is ``~``; ``%2F`` stays)."""
from __future__ import annotations

import re
from urllib.parse import urlsplit

_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
MAX_PATTERN_CHARS = 2048  # a longer location or Content-Usage path matches nothing real


def _normalised_escape(match: re.Match[str]) -> str:
    char = chr(int(match.group(1), 16))
    return char if char in _UNRESERVED else "%" + match.group(1).upper()


def normalise(path: str) -> str:
    """``path`` with unreserved characters decoded and other escapes in upper case."""
    return _ESCAPE.sub(_normalised_escape, path) if "%" in path else path


def url_path(url: str) -> str:
    """The path and query a pattern is matched against (``/`` for an empty path), normalised."""
    parts = urlsplit(url)
    path = parts.path or "/"
    return normalise(f"{path}?{parts.query}" if parts.query else path)


def regex_of(pattern: str) -> str:
    """A regular expression (for ``re.match``) that matches the paths ``pattern`` does."""
    anchored = pattern.endswith("$")
    body = normalise(pattern[:-1] if anchored else pattern)
    return ".*".join(re.escape(part) for part in body.split("*")) + (r"\Z" if anchored else "")


class FirstMatch:
    """Patterns in order; ``first(path)`` is the index of the first that matches (TDMRep: "the most
    specific match is the first in sequence"). Each pattern is filed under its literal prefix (up
    to its first ``*``), so a path is matched only against the patterns whose prefix it starts
    with: a few dictionary reads per distinct prefix length, however many patterns a file has."""

    def __init__(self, patterns: list[str]):
        self._by_prefix: dict[str, list[tuple[int, re.Pattern[str]]]] = {}
        for index, pattern in enumerate(patterns):
            body = normalise(pattern[:-1] if pattern.endswith("$") else pattern)
            prefix = body.split("*", 1)[0]
            self._by_prefix.setdefault(prefix, []).append((index, re.compile(regex_of(pattern), re.DOTALL)))
        self._lengths = sorted({len(prefix) for prefix in self._by_prefix})

    def first(self, path: str) -> int | None:
        best: int | None = None
        for length in self._lengths:
            if length > len(path):
                break
            for index, regex in self._by_prefix.get(path[:length], ()):
                if best is not None and index > best:
                    break
                if regex.match(path):
                    best = index
                    break
        return best


class LongestMatch:
    """Patterns with values; ``best(path)`` the value of the longest pattern that matches
    (RFC 9309's rule for Allow and Disallow, which Content-Usage rules follow), or None."""

    def __init__(self, rules: list[tuple[str, str]]):
        ordered = sorted(rules, key=lambda rule: -len(rule[0].encode()))
        self._rules = [(re.compile(regex_of(pattern), re.DOTALL), value) for pattern, value in ordered]

    def best(self, path: str) -> str | None:
        for regex, value in self._rules:
            if regex.match(path):
                return value
        return None

    def __bool__(self) -> bool:
        return bool(self._rules)
