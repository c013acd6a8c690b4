"""One lane per source a worker knows: its queue, its tasks and what was learned of it here.

The scheduler holds its sources only through ``Lanes``: every fact of a source is a field of
its ``Lane``, and the indexes (the rotation of the sources with URLs queued, those with tasks
running, those with slots reserved, the fast ones) hold lanes, not facts of their own.
"""
from __future__ import annotations

from collections.abc import Iterator, Set
from dataclasses import dataclass, field

from common.contracts import CrawlRequest
from worker.constants import DEFAULT_LATENCY, THROUGHPUT_WARMUP_SECONDS
from worker.intake.feed import TP
from worker.scheduling.sizing import throughput


@dataclass(frozen=True, slots=True)
class Job:
    tp: TP
    offset: int
    request: CrawlRequest | None  # None: a message to reject


@dataclass(eq=False, slots=True)
class Lane:
    """Kept small, as a worker holds one per source: its queue a list (at most QUEUE_MAX_PER_SOURCE
    long, so taking its first is a short copy; an empty deque holds a block) and ``fed_from`` an
    empty frozenset shared by the slow lanes (docs/decisions.md, "Fleet scale")."""
    source: str
    queue: list[Job] = field(default_factory=list)  # URLs waiting here for a slot, oldest first
    running: int = 0                # tasks running now
    reserved: int = 0               # slots reserved for it at the last reallocation (its need)
    fast: bool = False              # paced at FAST_SOURCE_RATE or more, with work here
    fed_from: Set[TP] = frozenset()  # partitions its URLs came from, while fast
    latency: float = DEFAULT_LATENCY  # seconds a task takes, smoothed
    throughput: float | None = None   # URLs ended here a second, smoothed; None: not measured
    ended: int = 0                  # URLs ended here since the last measure
    working_since: float | None = None  # when it last began to have work here (monotonic)
    worked_before: bool = False     # it had work at the last measure
    ran_dry: bool = False           # its queue emptied since the last measure
    new: bool = False               # queued here since the last refresh: its limit is read
    parked_lately: bool = False     # parked since the last refresh: its limit is read
    last_turn: float = 0.0          # when its latest parked URL may go (wall clock)

    @property
    def working(self) -> bool:
        return bool(self.queue) or self.running > 0

    def measure(self, elapsed: float, now: float, counted: bool) -> None:
        """At a refresh, ``elapsed`` s after the last (``counted``: a last one to measure from):
        its URLs ended here a second (``sizing.throughput``), if it had work through the whole
        interval and is past its first THROUGHPUT_WARMUP_SECONDS here (its robots.txt, its first
        tokens); idle here, what it achieved is history."""
        ended, self.ended = self.ended, 0
        working = self.working
        measured, self.worked_before = self.worked_before and working, working
        if not working:
            self.working_since, self.throughput = None, None
        elif self.working_since is None:
            self.working_since = now
        if not counted:
            return
        dry, self.ran_dry = self.ran_dry, False
        if measured and self.working_since is not None and now - self.working_since >= THROUGHPUT_WARMUP_SECONDS:
            self.throughput = throughput(self.throughput, ended, elapsed, self.running, dry)

    def fed(self, tp: TP) -> None:
        """A URL of this (fast) lane came from ``tp``."""
        if tp not in self.fed_from:
            self.fed_from = self.fed_from | {tp}

    def forget(self) -> None:
        """Back to what a new source's lane knows, but for the turn of its latest parked URL."""
        self.fast, self.fed_from, self.latency, self.throughput = False, frozenset(), DEFAULT_LATENCY, None


class Lanes:
    def __init__(self) -> None:
        self._all: dict[str, Lane] = {}
        self.waiting: dict[str, Lane] = {}   # lanes with URLs queued; insertion order is the rotation
        self.running: dict[str, Lane] = {}   # lanes with a task running
        self.reserved: dict[str, Lane] = {}  # lanes with slots reserved
        self.fast: dict[str, Lane] = {}      # fast lanes with work here

    def __iter__(self) -> Iterator[Lane]:
        return iter(self._all.values())

    def __len__(self) -> int:
        return len(self._all)

    def get(self, source: str) -> Lane | None:
        return self._all.get(source)

    def lane(self, source: str) -> Lane:
        lane = self._all.get(source)
        if lane is None:
            lane = self._all[source] = Lane(source)
        return lane

    def working(self) -> dict[str, Lane]:
        """The lanes with URLs queued or tasks running."""
        return self.waiting | self.running

    def forget_idle(self, now: float) -> None:
        """Idle lanes forget what was learned of their sources; those with no parked URL to
        place after (its turn past) go."""
        for source, lane in list(self._all.items()):
            if not lane.working:
                if lane.last_turn > now:
                    lane.forget()
                else:
                    del self._all[source]


def starters(lanes: Lanes, shared_free: int, slow_open: bool, first_place: int) -> tuple[list[Lane], int]:
    """The lanes that may start a task, in the order they are offered one, and the next first place.

    With a shared slot free and the slow sources' allowance open, every queued lane, in rotation.
    Else only those that can start: with no shared slot free the lanes with a reservation, with
    no allowance the fast ones (of them, the reserved ones if no shared slot is free either), which
    spares going round thousands of queued lanes at each task's end. Those few are offered in the
    same order each time, so the first place goes round: else the first would take every slot
    that frees."""
    if shared_free > 0 and slow_open:
        return list(lanes.waiting.values()), first_place
    reserved, fast, waiting = lanes.reserved, lanes.fast, lanes.waiting
    few = reserved if shared_free <= 0 and slow_open else (
        fast if shared_free > 0 else {s: lane for s, lane in fast.items() if s in reserved})
    candidates = [lane for s, lane in few.items() if s in waiting]
    if candidates:
        first_place = (first_place + 1) % len(candidates)
        candidates = candidates[first_place:] + candidates[:first_place]
    return candidates, first_place
