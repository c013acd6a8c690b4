"""Reading past the memory bound: records left in Kafka, to be read again after a rewind.

At MAX_QUEUED_URLS the scheduler does not stop reading: it reads on and takes only the URLs of
sources that need them now (``Scheduler._admitted_past_bound``); every other record is *left*:
not held, not parked, not committed. Each partition keeps the offsets it left as ranges (a run
of slow sources' URLs is one range, whatever its length), its commit stays below the first of
them, and once the worker has room again it seeks back there (``rewind``) and takes them on the
second reading. Records taken on the first reading are not taken again: below the highest
offset read, only a left offset is new (docs/decisions.md, "Admission by need").

A partition stops (pauses) once it has read READ_AHEAD_MAX records in a row that no fast source
needed (``unneeded``): the run starts again at each fast source's URL read there, taken or left
because its queue is full, and at each seek. Counted by what was left instead, a partition holding
a fast source's own left URLs paused ahead of them, and stayed paused, since only reading it could
mark them again.
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
        self._unneeded: dict[TP, int] = {}  # records read past the bound since a fast source's URL or a seek

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

    def read_unneeded(self, tp: TP) -> None:
        """A record of ``tp`` read past the bound that no fast source needed."""
        self._unneeded[tp] = self._unneeded.get(tp, 0) + 1

    def needed(self, tp: TP) -> None:
        """A fast source's URL read in ``tp``, or ``tp`` sought: it reads on."""
        self._unneeded.pop(tp, None)

    def unneeded(self, tp: TP) -> int:
        """Records ``tp`` read in a row that no fast source needed: it pauses from READ_AHEAD_MAX."""
        return self._unneeded.get(tp, 0)

    def rewind(self) -> dict[TP, int]:
        """Where each partition that left records is read again from: its first left offset."""
        return {tp: ranges[0][0] for tp, ranges in self._ranges.items()}

    def forget(self, parts: list[TP]) -> None:
        """Revoked: the next owner reads them from the commit, which is below them."""
        for tp in parts:
            self._ranges.pop(tp, None)
            self._counts.pop(tp, None)
            self._unneeded.pop(tp, None)

    def __len__(self) -> int:
        return sum(self._counts.values())

    def spans(self) -> int:
        """Ranges held, all partitions: what this costs in memory."""
        return sum(len(ranges) for ranges in self._ranges.values())


class FastMarks:
    """Per partition, for each fast source whose queue was full there, an offset its left URLs are
    all at or past: the partition is read again from the least of them when the source runs short.

    A mark moves on as the partition is read past it: from a seek (or its first left record) the
    reading is in order, so once it has passed a mark, the source's first URL left in what was read
    is the new mark, or, if none, the first offset not read yet. Deleted when sought, as before,
    a mark was lost whenever another seek (every partition's, every REREAD_SECONDS) came before the
    marked records were read again, and the partition, paused after READ_AHEAD_MAX records no fast
    source needed, never reached them: the fast source stood still for minutes."""

    def __init__(self) -> None:
        self._marks: dict[TP, dict[str, int]] = {}
        self._reading: dict[TP, list[int]] = {}      # [first, last] offset read in order since the last seek
        self._found: dict[TP, dict[str, int]] = {}   # each source's first URL left in that reading

    def read(self, tp: TP, offset: int) -> None:
        """A record of ``tp`` read (every record, for a partition with marks)."""
        reading = self._reading.get(tp)
        if reading is not None and offset >= reading[0]:
            reading[1] = max(reading[1], offset)

    def left(self, tp: TP, source: str, offset: int) -> None:
        """A URL of the fast ``source`` left in ``tp``."""
        marks = self._marks.setdefault(tp, {})
        if source not in marks or offset < marks[source]:
            marks[source] = offset
        reading = self._reading.setdefault(tp, [offset, offset])
        if reading[0] <= offset <= reading[1]:
            found = self._found.setdefault(tp, {})
            if source not in found or offset < found[source]:
                found[source] = offset

    def sought(self, tp: TP, offset: int) -> None:
        """``tp`` is read again from ``offset`` (at or below every mark of it)."""
        self._settle(tp)
        if tp in self._marks:
            self._reading[tp] = [offset, offset - 1]

    def marks(self, tp: TP) -> dict[str, int]:
        """Where each fast source's URLs left in ``tp`` are, at the earliest."""
        self._settle(tp)
        return self._marks.get(tp, {})

    def partitions(self) -> list[TP]:
        return list(self._marks)

    def drop(self, tp: TP, sources: list[str]) -> None:
        marks = self._marks.get(tp, {})
        for source in sources:
            marks.pop(source, None)
        if not marks:
            self.forget([tp])

    def forget(self, parts: list[TP]) -> None:
        for tp in parts:
            self._marks.pop(tp, None)
            self._reading.pop(tp, None)
            self._found.pop(tp, None)

    def _settle(self, tp: TP) -> None:
        reading, marks = self._reading.get(tp), self._marks.get(tp)
        if reading is None or marks is None:
            return
        first, last = reading
        found = self._found.pop(tp, {})
        for source, mark in marks.items():
            if first <= mark <= last:
                marks[source] = found.get(source, last + 1)
        reading[0] = last + 1
