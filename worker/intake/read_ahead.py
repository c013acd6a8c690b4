"""Reading past the memory bound: records left in Kafka, to be read again after a rewind.

At MAX_QUEUED_URLS the scheduler does not stop reading: it reads on and takes only the URLs of
sources that need them now (``Scheduler._admitted_past_bound``); every other record is *left*:
not held, not parked, not committed. Each partition keeps the offsets it left as ranges (a run
of slow sources' URLs is one range, whatever its length), its commit stays below the first of
them, and once the worker has room again it seeks back there (``rewind``) and takes them on the
second reading. Records taken on the first reading are not taken again: below the highest
offset read, only a left offset is new (docs/decisions.md, "Admission by need").
"""
from __future__ import annotations

import bisect

from worker.intake.feed import TP


def _start(piece: list[int]) -> int:
    return piece[0]


class LeftBehind:
    def __init__(self) -> None:
        self._ranges: dict[TP, list[list[int]]] = {}  # per partition, sorted disjoint [start, end)
        self._counts: dict[TP, int] = {}

    def leave(self, tp: TP, offset: int) -> None:
        """``offset`` of ``tp`` was read and left in Kafka."""
        ranges = self._ranges.setdefault(tp, [])
        i = bisect.bisect_right(ranges, offset, key=_start) - 1
        if i >= 0 and ranges[i][0] <= offset < ranges[i][1]:
            return  # left already (read again while still past the bound)
        if i >= 0 and ranges[i][1] == offset:
            ranges[i][1] = offset + 1
            if i + 1 < len(ranges) and ranges[i + 1][0] == offset + 1:
                ranges[i][1] = ranges.pop(i + 1)[1]
        elif i + 1 < len(ranges) and ranges[i + 1][0] == offset + 1:
            ranges[i + 1][0] = offset
        else:
            ranges.insert(i + 1, [offset, offset + 1])
        self._counts[tp] = self._counts.get(tp, 0) + 1

    def holds(self, tp: TP, offset: int) -> bool:
        ranges = self._ranges.get(tp)
        if not ranges:
            return False
        i = bisect.bisect_right(ranges, offset, key=_start) - 1
        return i >= 0 and ranges[i][0] <= offset < ranges[i][1]

    def take(self, tp: TP, offset: int) -> bool:
        """True if ``offset`` was left (it is taken now, no longer left)."""
        ranges = self._ranges.get(tp)
        if not ranges:
            return False
        i = bisect.bisect_right(ranges, offset, key=_start) - 1
        if i < 0 or not ranges[i][0] <= offset < ranges[i][1]:
            return False
        start, end = ranges[i]
        pieces = [piece for piece in ([start, offset], [offset + 1, end]) if piece[0] < piece[1]]
        ranges[i:i + 1] = pieces
        self._counts[tp] -= 1
        if not ranges:
            del self._ranges[tp], self._counts[tp]
        return True

    def first(self, tp: TP) -> int | None:
        """The lowest offset ``tp`` left: its commit may not pass it."""
        ranges = self._ranges.get(tp)
        return ranges[0][0] if ranges else None

    def count(self, tp: TP) -> int:
        """Records ``tp`` left."""
        return self._counts.get(tp, 0)

    def rewind(self) -> dict[TP, int]:
        """Where each partition that left records is read again from: its first left offset."""
        return {tp: ranges[0][0] for tp, ranges in self._ranges.items()}

    def forget(self, parts: list[TP]) -> None:
        """Revoked: the next owner reads them from the commit, which is below them."""
        for tp in parts:
            self._ranges.pop(tp, None)
            self._counts.pop(tp, None)

    def __len__(self) -> int:
        return sum(self._counts.values())

    def spans(self) -> int:
        """Ranges held, all partitions: what this costs in memory."""
        return sum(len(ranges) for ranges in self._ranges.values())
