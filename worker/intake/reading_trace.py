"""A trace of the reading past the memory bound, for benches: what each partition left, why, and
where it was read again from, logged every TRACE_SECONDS as one debug event per worker.

Counts only (per partition, and per source for the few sources found fast), so that it costs
nothing that grows with the number of sources (docs/decisions.md, "Admission by need").
"""
from __future__ import annotations

import time
from collections import Counter

from common.contracts import EVENT_WORKER_READING_TRACE
from common.jsonlog import log_event
from worker.constants import TRACE_SECONDS
from worker.intake.feed import TP

TAKEN, TAKEN_AGAIN = "taken", "taken_again"  # on the first reading; a left record, on a later one
LEFT_SLOW, LEFT_UNKNOWN, LEFT_FULL, LEFT_STOPPED = "left_slow", "left_unknown", "left_full", "left_stopped"
SKIPPED_AGAIN = "skipped_again"  # read again, not left before (taken on an earlier reading)


class ReadingTrace:
    def __init__(self) -> None:
        self._by_partition: dict[TP, Counter[str]] = {}
        self._by_source: dict[str, Counter[str]] = {}
        self._seeks: dict[TP, tuple[str, int, float]] = {}  # the last: why, to where, when
        self._next = 0.0

    def note(self, tp: TP, outcome: str, source: str | None = None) -> None:
        """A record of ``tp`` read with ``outcome``; ``source`` counted apart (a fast one)."""
        self._by_partition.setdefault(tp, Counter())[outcome] += 1
        if source is not None:
            self._by_source.setdefault(source, Counter())[outcome] += 1

    def sought(self, why: str, positions: dict[TP, int]) -> None:
        now = time.monotonic()
        for tp, offset in positions.items():
            self._by_partition.setdefault(tp, Counter())[f"seek_{why}"] += 1
            self._seeks[tp] = (why, offset, now)

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def emit(self, state: dict, partitions: dict[TP, dict]) -> None:
        """Log ``state`` (the scheduler's) and, per partition, ``partitions``' facts with what was
        counted since the last trace; the counts start again."""
        now = time.monotonic()
        self._next = now + TRACE_SECONDS
        rows = []
        for tp in sorted(partitions.keys() | self._by_partition.keys()):
            row = {"partition": tp[1], **partitions.get(tp, {}), **self._by_partition.get(tp, {})}
            if tp in self._seeks:
                why, offset, at = self._seeks[tp]
                row["last_seek"] = [why, offset, round(now - at, 1)]
            rows.append(row)
        log_event(EVENT_WORKER_READING_TRACE, **state, by_source={s: dict(c) for s, c in self._by_source.items()},
                  partitions=rows)
        self._by_partition.clear()
        self._by_source.clear()
