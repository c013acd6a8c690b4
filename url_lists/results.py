"""The output topics as one row per URL: its outcome and what was measured.

SPEC.md §1's outcomes arrive as up to two messages per URL: a success is a
quality message, preceded by an EXIF message where the image has EXIF (both
keyed by the URL's uuid, so on one partition in that order); link rot and
errors are one message each. ``Joiner`` holds an EXIF message until its
quality message comes, and turns each outcome into a row of ``SCHEMA``.
"""
from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from common import contracts
from common.robots_tag import forbids_thumbnail

# Link rot and opt-outs are named after their topics.
SUCCESS, LINK_ROT, ERROR, OPTED_OUT = "success", contracts.LINK_ROT_TOPIC, "error", contracts.OPTED_OUT_TOPIC
SCHEMA = pa.schema([
    ("identifier", pa.string()),
    ("outcome", pa.string()),               # success, link_rot, error or opted_out
    ("reason", pa.string()),                # an error's reason (crawl_errors)
    ("status", pa.int32()),                 # an error's HTTP status, if it had one; an opt-out's, if requested
    ("url", pa.string()),                   # known for errors and opt-outs only (their messages carry it)
    ("width", pa.int32()),
    ("height", pa.int32()),
    ("compression_quality", pa.int32()),    # JPEG quality 1-100; null for other formats
    ("filesize", pa.int64()),               # bytes downloaded
    ("exif", pa.string()),                  # the EXIF message's object as JSON; null without EXIF
    ("x_robots_tag", pa.list_(pa.string())),
    ("thumbnail_key", pa.string()),         # the thumbnail's S3 key; null where none was stored
    ("signal", pa.string()),                # an opt-out's signal (robots-txt, tdmrep-file, x-robots-tag, ...)
    ("signal_value", pa.string()),          # and the value that decided it ("/photos/* reserved")
])
# An EXIF message waits this many later messages of its partition for its quality message
# (the worker sends that right after the EXIF one is acknowledged); past it, it is dropped.
EXIF_WAIT_MESSAGES = 10_000


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


class Joiner:
    """Outcome messages in, rows out; pending EXIF messages by identifier."""

    def __init__(self) -> None:
        self.pending: dict[str, tuple[str, int, int]] = {}  # identifier -> (exif JSON, partition, offset)
        self.unreadable = 0

    def feed(self, topic: str, partition: int, offset: int, raw: bytes | None) -> dict[str, Any] | None:
        """The row this message completes, or None (an EXIF message, or one that is unreadable)."""
        try:
            message = json.loads(raw or b"")
            identifier = message["identifier"]
            if not isinstance(identifier, str):
                raise TypeError("identifier")
        except (ValueError, TypeError, KeyError, RecursionError):
            self.unreadable += 1
            return None
        if topic == contracts.METADATA_TOPIC:
            if "width" not in message:
                if isinstance(message.get("exif"), dict):
                    self.pending[identifier] = (json.dumps(message["exif"]), partition, offset)
                return None
            return self._success(identifier, message, partition)
        if topic == contracts.LINK_ROT_TOPIC:
            return {"identifier": identifier, "outcome": LINK_ROT}
        if topic == contracts.CRAWL_ERRORS_TOPIC:
            return {"identifier": identifier, "outcome": ERROR, "reason": _text(message.get("reason")),
                    "status": _int(message.get("status")), "url": _text(message.get("url"))}
        if topic == contracts.OPTED_OUT_TOPIC:
            return {"identifier": identifier, "outcome": OPTED_OUT, "status": _int(message.get("status")),
                    "url": _text(message.get("url")), "signal": _text(message.get("signal")),
                    "signal_value": _text(message.get("value"))}
        return None

    def _success(self, identifier: str, message: dict[str, Any], partition: int) -> dict[str, Any]:
        exif = self.pending.get(identifier)
        if exif is not None and exif[1] == partition:
            del self.pending[identifier]
        tags = message.get("x_robots_tag")
        tags = [tag for tag in tags if isinstance(tag, str)] if isinstance(tags, list) else []
        return {"identifier": identifier, "outcome": SUCCESS, "width": _int(message.get("width")),
                "height": _int(message.get("height")),
                "compression_quality": _int(message.get("compression_quality")),
                "filesize": _int(message.get("filesize")), "exif": exif[0] if exif else None,
                "x_robots_tag": tags,
                "thumbnail_key": None if forbids_thumbnail(tags) else contracts.thumbnail_key(identifier)}

    def expire(self, partition: int, offset: int) -> None:
        """Drop EXIF messages of ``partition`` too far behind ``offset`` to expect their quality message."""
        stale = [identifier for identifier, (_, p, at) in self.pending.items()
                 if p == partition and offset - at > EXIF_WAIT_MESSAGES]
        for identifier in stale:
            del self.pending[identifier]

    def oldest_pending(self, partition: int) -> int | None:
        offsets = [at for _, p, at in self.pending.values() if p == partition]
        return min(offsets) if offsets else None
