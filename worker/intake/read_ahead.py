"""Reading past the memory bound: records left in Kafka, to be read again after a rewind.

At MAX_QUEUED_URLS the scheduler does not stop reading: it reads on and takes only the URLs of
sources that need them now (``ReadAhead``); every other record is *left*:
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
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from common.contracts import EVENT_WORKER_REFRESH_FAILED, InvalidMessage, parse_crawl_request
from common.jsonlog import log_event
from common.protocols import AsyncRedis
from worker.constants import (FAST_LEARNED_MAX, FAST_ROOM, FAST_SOURCE_RATE, LEARNED_SECONDS, LOOKUP_INTERVAL,
                              LOOKUP_MAX, READ_AHEAD_MAX, REREAD_SECONDS, REWIND_INTERVAL, SLOW_PARTITIONS_PAUSE_AT)
from worker.intake.feed import TP, Record
from worker.intake.offsets import PartitionOffsets
from worker.intake.reading_trace import (LEFT_FULL, LEFT_SLOW, LEFT_STOPPED, LEFT_UNKNOWN, SKIPPED_AGAIN, TAKEN,
                                         TAKEN_AGAIN, ReadingTrace)
from worker.monitor_view import MonitorView
from worker.scheduling import sizing
from worker.scheduling.lanes import Lane, Lanes


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


def past_the_bound(held: int, max_queued: int, was_past: bool) -> bool:
    """Whether a worker holding ``held`` URLs (the fast sources' queues not counted) reads past its
    bound: from MAX_QUEUED_URLS less FAST_ROOM of it, and (``was_past``) until half of it has gone."""
    return held >= max_queued - int(max_queued * FAST_ROOM) or (was_past and held > max_queued // 2)


def pause_short_of_the_bound(held: int, max_queued: int, pausing: bool) -> bool:
    """Short of the bound, whether the partitions that feed no fast source are paused: from
    SLOW_PARTITIONS_PAUSE_AT of MAX_QUEUED_URLS, and (``pausing``: some are) until half has gone."""
    return held >= max_queued * SLOW_PARTITIONS_PAUSE_AT or (pausing and held > max_queued // 2)


def _note_first(firsts: dict, key: object, offset: int) -> None:
    """``firsts[key]``: the lowest offset noted for it."""
    if key not in firsts or offset < firsts[key]:
        firsts[key] = offset


@dataclass(frozen=True)
class Reading:
    """What ``ReadAhead.bound`` decided for the feed: partitions paused, and read again from where."""
    paused: set[TP]
    seek: dict[TP, int]
    why: str  # the seek's reason, for the trace: "half", "reread" or "need"


class ReadAhead:
    """The reading past MAX_QUEUED_URLS, one per worker (issue 44): whether it is past the bound,
    which records it takes there (``takes``, ``takes_again``: a fast source's, its queue not full)
    and what it leaves (``LeftBehind``, ``FastMarks``), the sources it looks up, and which
    partitions are paused or read again (``bound``); traced (``ReadingTrace``).
    The numbers: docs/decisions.md, "Admission by need" and "Fleet scale"."""

    def __init__(self, max_queued: int, view: MonitorView, lanes: Lanes, pace: Callable[[str], float],
                 queue_limit: Callable[[Lane], int]) -> None:
        """``view``, ``lanes``, ``pace`` and ``queue_limit``: the scheduler's, read only."""
        self._max_queued = max_queued
        self._view = view
        self._lanes = lanes
        self._pace = pace
        self._queue_limit = queue_limit
        self._left = LeftBehind()                  # records read past the bound and left in Kafka
        self._marks = FastMarks()                  # where fast sources' URLs were left (their queue full)
        self._trace = ReadingTrace()               # what was left and why, logged every few seconds
        self._past_bound = False                   # reading past MAX_QUEUED_URLS: only fast sources' URLs taken
        self._unknown: dict[str, dict[TP, int]] = {}  # sources read past the bound, rate unknown: first URL left where
        self._learned: dict[str, tuple[float, float]] = {}  # fast sources by a look-up: (pace, when)
        self._was_fast: set[str] = set()           # sources found fast past the bound: looked up again when read
        self._rewound_at: dict[TP, float] = {}     # when a partition was last read again for them
        self._next_lookup = 0.0
        self._next_reread = 0.0                    # past the bound, when every partition is read again
        self._fast_held = 0                        # the fast sources' queued URLs, at the last bound check
        self._slow_held = 0                        # the others' URLs held, at the last bound check

    @property
    def past_bound(self) -> bool:
        return self._past_bound

    # --- each record read --------------------------------------------------------
    def read(self, tp: TP, offset: int, held: int) -> None:
        """A record of ``tp`` read, ``held`` URLs held here: past the bound from this record on if
        they reach it (not a batch later)."""
        if not self._past_bound and past_the_bound(held - self._fast_held, self._max_queued, False):
            self._past_bound = True
            self._next_reread = time.monotonic() + REREAD_SECONDS
        self._marks.read(tp, offset)

    def takes(self, record: Record, tp: TP, held: int) -> bool:
        """A record read for the first time: taken, unless past the bound and not admitted (then
        the scheduler ``leave``s it)."""
        return not self._past_bound or self._admitted(record, tp, held)

    def takes_again(self, record: Record, tp: TP, held: int) -> bool:
        """A record read again after a seek (its offset seen before): taken only if it was left,
        and, past the bound, admitted now; then it is no longer left."""
        if not self._left.holds(tp, record.offset):
            self._trace.note(tp, SKIPPED_AGAIN)
            if self._past_bound:
                self._left.read_unneeded(tp)
            return False
        if self._past_bound and not self._admitted(record, tp, held, look_up=False):
            return False
        self._left.take(tp, record.offset)
        return True

    def leave(self, tp: TP, offset: int) -> None:
        """``offset`` of ``tp`` left in Kafka: not held, not committed; read again after the rewind."""
        self._left.leave(tp, offset)

    def first_left(self, tp: TP) -> int | None:
        """The lowest offset ``tp`` left: its commit may not pass it."""
        return self._left.first(tp)

    def forget(self, revoked: list[TP]) -> None:
        """Revoked: what they left is uncommitted, and the next owner reads it from the commit."""
        self._left.forget(revoked)
        for tp in revoked:
            self._rewound_at.pop(tp, None)
        self._marks.forget(revoked)

    def _admitted(self, record: Record, tp: TP, held: int, look_up: bool = True) -> bool:
        """Past the bound, whether a URL is taken: its source is paced at FAST_SOURCE_RATE or more
        (it needs URLs every few seconds), not stopped, and its queue here not full (else the URL is
        left in Kafka, and the partition read again from what it left once the queue runs short:
        no turn round the wait topics). A source not working here (unknown, or its rate stale) is
        looked up, for its next URLs (``look_up``: on a record's first reading; on later readings
        only a source that was fast before); a message that is no crawl request is taken (to reject it).
        What it decides is traced (``worker.intake.reading_trace``)."""
        outcome, source = self._admission(record, tp, held, look_up)
        if outcome in (TAKEN, LEFT_FULL):  # a fast source's: its partition reads on
            self._left.needed(tp)
        else:
            self._left.read_unneeded(tp)
        watched = source if source in self._was_fast or source in self._learned else None
        self._trace.note(tp, TAKEN_AGAIN if outcome == TAKEN and not look_up else outcome, watched)
        return outcome == TAKEN

    def _admission(self, record: Record, tp: TP, held: int, look_up: bool) -> tuple[str, str | None]:
        if record.key:
            source = record.key.decode("utf-8", "replace")
        else:
            try:
                source = parse_crawl_request(record.value).source
            except InvalidMessage:
                return TAKEN, None
        view = self._view
        if source in view.stopped:
            return LEFT_STOPPED, source
        lane = self._lanes.get(source)
        learned = self._learned.get(source)
        if lane is not None and lane.working and view.rate(source) is not None:  # its rate read lately
            pace = self._pace(source)
        elif learned is not None and time.monotonic() < learned[1] + LEARNED_SECONDS:
            pace = learned[0]
        else:  # unknown here, or known from before it went idle here (a stale rate): looked up
            was_fast = source in self._was_fast or self._pace(source) >= FAST_SOURCE_RATE  # a stale rate: a hint
            if (look_up or was_fast) and (source in self._unknown or len(self._unknown) < LOOKUP_MAX):
                _note_first(self._unknown.setdefault(source, {}), tp, record.offset)
            return LEFT_UNKNOWN, source
        if pace < FAST_SOURCE_RATE:
            return LEFT_SLOW, source
        self._was_fast.add(source)
        if held < self._max_queued:  # the fast sources' room: the bound holds for all
            if lane is None:
                return TAKEN, source
            limit = sizing.queue_limit(True, pace, lane.reserved) if learned is not None and not lane.working \
                else self._queue_limit(lane)
            if len(lane.queue) < limit:
                return TAKEN, source
        self._marks.left(tp, source, record.offset)
        return LEFT_FULL, source

    # --- each round of the loop ------------------------------------------------------
    async def look_up_if_due(self, redis: AsyncRedis) -> None:
        """The rates (or limits) of the sources read past the bound and unknown here: those found
        fast have their next URLs taken."""
        now = time.monotonic()
        if not self._unknown or now < self._next_lookup:
            return
        self._next_lookup = now + LOOKUP_INTERVAL
        unknown, self._unknown = self._unknown, {}
        try:
            found = await self._view.potential(redis, sorted(unknown))
        except Exception as exc:  # noqa: BLE001 - Redis away: they are looked up when read again
            log_event(EVENT_WORKER_REFRESH_FAILED, error=repr(exc)[:300])
            return
        if len(self._learned) > FAST_LEARNED_MAX:
            self._learned.clear()
        if len(self._was_fast) > FAST_LEARNED_MAX:
            self._was_fast.clear()
        now = time.monotonic()
        for source, pace in found.items():
            if pace >= FAST_SOURCE_RATE:
                self._learned[source] = (pace, now)
                for tp, offset in unknown[source].items():  # left before it was known: read again by need
                    self._marks.left(tp, source, offset)
            else:
                self._learned.pop(source, None)

    def bound(self, held: int, assigned: set[TP], paused: set[TP], offsets: Mapping[TP, PartitionOffsets]) -> Reading:
        """The bound on the worker's memory, whatever the number of sources, ``held`` URLs held here
        (queued or being parked): past MAX_QUEUED_URLS less FAST_ROOM of it (the fast sources'
        queues not counted), every partition is read on, but only the fast sources' URLs are taken,
        up to the bound itself; the others are left in Kafka, a partition that read READ_AHEAD_MAX
        in a row that no fast source needed is paused until it is read again. At half the bound the
        partitions are read again from what they left (and every REREAD_SECONDS past it; a fast
        source short of URLs, from the first it left).

        Short of the bound (from SLOW_PARTITIONS_PAUSE_AT of it), and until half has gone, only the
        partitions that feed a fast source are read: its URLs come back there from their wait."""
        fast = self._lanes.fast
        self._fast_held = fast_held = sum(len(lane.queue) for lane in fast.values())
        self._slow_held = held = held - fast_held
        feeding = assigned.intersection(set().union(*(lane.fed_from for lane in fast.values())))
        past_bound = past_the_bound(held, self._max_queued, self._past_bound)
        now = time.monotonic()
        if past_bound and not self._past_bound:
            self._next_reread = now + REREAD_SECONDS
        # At half the bound; and every REREAD_SECONDS past it, for a fast source's URLs left unmarked
        # (read while it was paused, or not looked up).
        rewind = (self._past_bound and not past_bound) or (past_bound and now >= self._next_reread)
        self._past_bound = past_bound
        if rewind:
            self._next_reread = now + REREAD_SECONDS
            # The marks stay: read from its first left record, a partition may pause (READ_AHEAD_MAX)
            # before it reaches a fast source's URLs; a mark reads them again from there.
            positions = {tp: offset for tp, offset in self._left.rewind().items() if tp in assigned}
            why = "reread" if past_bound else "half"
            for tp in assigned:  # every partition reads on, a paused one with nothing left too
                self._left.needed(tp)
        elif past_bound:
            positions, why = self._read_again_for_fast_sources(assigned, offsets), "need"
        else:
            positions, why = {}, ""
        for tp, offset in positions.items():  # read again: resumed (a paused partition would deliver nothing)
            self._left.needed(tp)
            self._marks.sought(tp, offset)
        if past_bound:
            wanted = {tp for tp in assigned if self._left.unneeded(tp) >= READ_AHEAD_MAX}
        elif feeding and pause_short_of_the_bound(held, self._max_queued, bool(paused)):
            # With no fast source working here nothing pauses short of the bound: past it the
            # reading goes on for the fast sources' URLs behind the others.
            wanted = assigned - feeding
        else:
            wanted = set()
        return Reading(paused=wanted, seek=positions, why=why)

    def _read_again_for_fast_sources(self, assigned: set[TP], offsets: Mapping[TP, PartitionOffsets]) -> dict[TP, int]:
        """Past the bound, the partitions where a fast source whose queue has run short (under half
        its limit) left URLs: read again from the first URL a fast source left there (its mark, not
        the slow sources' before it), at most once per REWIND_INTERVAL each. A mark moves on as the
        partition is read past it (``FastMarks``) and goes once nothing at or past it was read."""
        now = time.monotonic()
        positions: dict[TP, int] = {}
        for tp in self._marks.partitions():
            read = offsets.get(tp)
            if tp not in assigned or read is None or self._left.first(tp) is None:
                self._marks.forget([tp])
                continue
            firsts = self._marks.marks(tp)
            gone = [source for source, offset in firsts.items() if not read.seen(offset)]  # read past all
            if gone:
                self._marks.drop(tp, gone)
            if not firsts or now < self._rewound_at.get(tp, 0.0) + REWIND_INTERVAL:
                continue
            if any((lane := self._lanes.get(source)) is None or len(lane.queue) < self._queue_limit(lane) // 2
                   for source in firsts):
                positions[tp] = min(firsts.values())
                self._rewound_at[tp] = now
        return positions

    # --- the debug trace -------------------------------------------------------------
    def seeking(self, reading: Reading) -> None:
        """The feed seeks to ``reading.seek`` now: traced."""
        self._trace.sought(reading.why, reading.seek)

    def trace_if_due(self, held: int, assigned: set[TP], paused: set[TP],
                     offsets: Mapping[TP, PartitionOffsets]) -> None:
        """Every TRACE_SECONDS while past the bound or records are left, ``worker_reading_trace``:
        the fast sources' lanes, and per partition what it left, the fast sources' first URLs left
        there, whether it is paused; ``held``: all the URLs held here now."""
        if not (self._trace.due() and (self._past_bound or len(self._left))):
            return
        view, now = self._view, time.monotonic()
        watched = set(self._lanes.fast) | set(self._learned) | set(list(self._was_fast)[:20])
        lanes = {}
        for source in sorted(watched):
            lane = self._lanes.get(source)
            lanes[source] = {"rate": view.rate(source), "slow_start": view.slow_start_limit(source),
                             "learned": [round(v, 1) for v in self._learned[source]] if source in self._learned
                             else None}
            if lane is not None:
                lanes[source] |= {"queue": len(lane.queue), "limit": self._queue_limit(lane), "running": lane.running,
                                  "reserved": lane.reserved, "throughput": lane.throughput, "fast": lane.fast}
        partitions = {}
        for tp in sorted(assigned):
            left, marks, is_paused = self._left.count(tp), self._marks.marks(tp), tp in paused
            if left or marks or is_paused:
                read = offsets.get(tp)
                partitions[tp] = {"left": left, "unneeded": self._left.unneeded(tp),
                                  "first_left": self._left.first(tp), "marks": marks,
                                  "paused": is_paused, "committed": read.committed if read else None}
        self._trace.emit({"past_bound": self._past_bound, "held": held, "slow_held": self._slow_held,
                          "fast_held": self._fast_held, "left": len(self._left), "spans": self._left.spans(),
                          "unknown": len(self._unknown), "was_fast": len(self._was_fast), "now": round(now, 1),
                          "next_reread_in": round(self._next_reread - now, 1), "lanes": lanes}, partitions)
