"""Outcome messages of one run to (row, outcome) pairs.

The output topics (SPEC.md §1) carry every crawl's outcomes; a run's identifiers share a
prefix (``keys.row_identifier``), so a message of another run is passed over by a byte
search, unparsed. EXIF messages wait for their quality message in ``url_lists.results.Joiner``.
An outcome is a flat dict of the dataset's outcome columns, plus ``robots_wait`` and
``retry_after_wait`` (when the message says the URL waited)
and ``thumbnail_key`` (a success whose thumbnail is in S3). A topic this code does not know
gives an outcome named after the topic (another part of the crawler may add one, such as
opted-out rows); unknown fields are ignored.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from common import contracts
from url_lists.dataset.keys import row_of, run_prefix
from url_lists.results import ERROR, LINK_ROT, OPTED_OUT, SUCCESS, Joiner

OUTCOME_TOPICS = contracts.OUTCOME_TOPICS
# A success whose X-Robots-Tag forbids storing the image: the crawler kept no thumbnail.
X_ROBOTS_TAG_FORBIDS = "XRobotsTagForbidsImage"
THUMBNAIL_MISSING = "ThumbnailMissing"  # a success whose thumbnail S3 does not have


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def bad_row_outcome(reason: str | None, source_file: str | None, source_row: int | None) -> dict[str, Any]:
    return {"status": ERROR, "error_message": reason or "bad row", "bad": True,
            "source_file": source_file, "source_row": source_row}


class _Joiner(Joiner):
    """Also says where a joined success began: its EXIF message's offset, if it had one."""

    exif_offset: int | None = None

    def _success(self, identifier: str, message: dict[str, Any], partition: int) -> dict[str, Any]:
        held = self.pending.get(identifier)
        self.exif_offset = held[2] if held is not None and held[1] == partition else None
        return super()._success(identifier, message, partition)


class OutcomeReader:
    def __init__(self, run: uuid.UUID):
        self._run = run
        self._prefix = run_prefix(run).encode()
        self.joiner = _Joiner()

    def of_run(self, raw: bytes | None) -> bool:
        """Whether ``raw`` may be one of this run's (a byte search: most messages are not)."""
        return raw is not None and self._prefix in raw

    def feed(self, topic: str, partition: int, offset: int,
             raw: bytes | None) -> tuple[int, dict[str, Any], int] | None:
        """The row and outcome this message completes, and the offset of the outcome's first
        message (an EXIF message before its quality message); None for another run's message,
        an EXIF message (held), or one that cannot be read."""
        if not self.of_run(raw):
            return None
        assert raw is not None
        if topic not in OUTCOME_TOPICS:
            found = self._other(topic, raw)
            return None if found is None else (*found, offset)
        self.joiner.exif_offset = None
        joined = self.joiner.feed(topic, partition, offset, raw)
        if joined is None:
            return None
        row = row_of(joined["identifier"], self._run)
        if row is None:
            return None
        first = offset if self.joiner.exif_offset is None else self.joiner.exif_offset
        kind = joined["outcome"]
        if kind == SUCCESS:
            outcome: dict[str, Any] = {key: joined.get(key) for key in (
                "width", "height", "compression_quality", "filesize", "exif", "x_robots_tag")}
            if joined.get("thumbnail_key") is None:
                outcome.update(status=ERROR, error_message=X_ROBOTS_TAG_FORBIDS)
            else:
                outcome.update(status=SUCCESS, thumbnail_key=joined["thumbnail_key"])
        elif kind == LINK_ROT:
            outcome = {"status": LINK_ROT}
        elif kind == OPTED_OUT:
            outcome = {"status": OPTED_OUT, "error_message": f"{joined.get('signal')}: {joined.get('signal_value')}",
                       "http_status": joined.get("status")}
        else:
            outcome = {"status": ERROR, "error_message": joined.get("reason") or "unknown",
                       "http_status": joined.get("status")}
        self._waits(raw, outcome)
        return row, outcome, first

    def _other(self, topic: str, raw: bytes) -> tuple[int, dict[str, Any]] | None:
        message = _object(raw)
        identifier = message.get("identifier") if message else None
        row = row_of(identifier, self._run) if isinstance(identifier, str) else None
        if message is None or row is None:
            return None
        reason = message.get("reason") or message.get("signal")  # opted_out names its signal (SPEC.md §1)
        outcome = {"status": topic, "error_message": reason if isinstance(reason, str) else None,
                   "http_status": _int(message.get("status"))}
        self._waits(raw, outcome)
        return row, outcome

    @staticmethod
    def _waits(raw: bytes, outcome: dict[str, Any]) -> None:
        if b'"robots_wait_since"' in raw or b'"retry_after_since"' in raw:
            message = _object(raw) or {}
            outcome["robots_wait"] = message.get(contracts.ROBOTS_WAIT_FIELD) is not None
            outcome["retry_after_wait"] = message.get(contracts.RETRY_AFTER_WAIT_FIELD) is not None


def _object(raw: bytes) -> dict[str, Any] | None:
    try:
        message = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return message if isinstance(message, dict) else None

