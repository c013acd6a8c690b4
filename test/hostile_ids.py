"""Identifiers an attacker upstream of ``inbound_images`` would send, to reach outside S3_BUCKET,
to make two identifiers share a thumbnail, or to make S3 refuse a key (issue 29)."""
from __future__ import annotations

import itertools

# Ways to write a dot segment: plain, percent-encoded (once and twice), overlong UTF-8, and
# Unicode look-alikes (fullwidth full stop, one- and two-dot leaders).
DOTS = ["..", ".", "%2e%2e", "%2E%2E", "%252e%252e", ".%2e", "%c0%ae%c0%ae", "\uff0e\uff0e", "\u2025",
        "\u2024\u2024"]
# Ways to write a path separator: slash, backslash, encoded, overlong, and look-alikes
# (fullwidth solidus and reverse solidus, division slash, fraction slash).
SEPARATORS = ["/", "\\", "%2f", "%2F", "%5c", "%252f", "%c0%af", "\uff0f", "\uff3c", "\u2215", "\u2044"]

HANDWRITTEN = [
    "..\\x\\y", "../../other/owned", "../escape", "a/../../b", "..", ".", "./a", "a/./b", "a/..", "../",
    "..;/x", ".../x", "/abs", "//host/x", "a//b", "///", "/../x", "\\\\server\\share", "a\\..\\..\\b",
    "\\", "a?b", "?x-id=PutObject", "a#b", "#", "?", "a?versionId=1", "?acl", "?uploads", "a b", "a+b",
    "a&b", "a=b", "~", "!", "!21", "%21", "a!2Fb", "a%2Fb", "%", "%zz", "%00", "*", "'", '"',
    "<script>", "a;b", "$", "CON", "NUL", "aux.jpg", "x.jpg", "x.jpg.jpg", ".jpg", ":", "a:b", "@",
    "[", "{}", "|", "^", "`", "é", "e\u0301", "日本語", "\U0001f600", "\u2126", "\u03a9", "İ", "ß",
    "0B9F6A3E-4B0E-4C8E-9D5A-1F2E3D4C5B6A", "0b9f6a3e-4b0e-4c8e-9d5a-1f2e3d4c5b6a",
    "a" * 200, "." * 200, "../" * 66 + "ab", "%" * 200, "/" * 200, "\\" * 200, "é" * 200,
    "\U0001f600" * 200, "字" * 113, "字" * 114, "a\u202eb", "a\u200bb", "a\u00a0b", "a\x00b", "a\nb",
    " leading", "trailing ", "other/owned", "cc-image-analysis/../other/x",
]


def hostile_identifiers() -> list[str]:
    """About 200 distinct identifiers: the handwritten ones, then every dot spelling with every
    separator spelling, leading (aiming at another bucket) or inside a name, in turn."""
    made = list(HANDWRITTEN)
    for n, (dots, sep) in enumerate(itertools.product(DOTS, SEPARATORS)):
        made.append(f"{dots}{sep}{dots}{sep}other{sep}owned" if n % 2 else f"a{sep}{dots}{sep}{dots}{sep}b")
    return list(dict.fromkeys(made))
