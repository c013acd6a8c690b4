"""The rows of an unfinished shard that have their outcome, durable: one JSON line each.

``{folder}/_crawl/journal/{shard:05d}.jsonl`` is appended to as rows finish and synced in
groups (``sync``) before the Kafka offsets past them are saved; a line cut by a crash is
the last one, and is ignored (its message is read again). A shard's outputs are rebuilt
from its journal after a crash, so the journal, not the half-written shard, is the record.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

from url_lists.dataset.inputs import CRAWL_DIR

JOURNAL_DIR = "journal"


def journal_path(folder: Path, shard: int) -> Path:
    return folder / CRAWL_DIR / JOURNAL_DIR / f"{shard:05d}.jsonl"


def read_journal(path: Path) -> dict[int, dict[str, Any]]:
    """Row -> outcome; the first line of a row wins; an unreadable line is skipped."""
    found: dict[int, dict[str, Any]] = {}
    try:
        with path.open("rb") as lines:
            for line in lines:
                try:
                    entry = json.loads(line)
                    row, outcome = entry["row"], entry["outcome"]
                except (ValueError, KeyError, TypeError, RecursionError):
                    continue
                if isinstance(row, int) and isinstance(outcome, dict):
                    found.setdefault(row, outcome)
    except FileNotFoundError:
        pass
    return found


class Journal:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[bytes] | None = path.open("ab")
        self.dirty = False

    def append(self, row: int, outcome: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps({"row": row, "outcome": outcome}, separators=(",", ":")).encode() + b"\n")
        self.dirty = True

    def sync(self) -> None:
        """Everything appended is on the disk (blocking: call it off the event loop)."""
        if self._file is not None and self.dirty:
            self.dirty = False
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)
