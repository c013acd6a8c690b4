"""Which image the pool takes next: the earliest arrival, less its source's head start.

The pool holds a few images per process; the others wait here. A task holds its source's
slot while its image waits, so a big site's rate falls to its slots over this wait; taken in
arrival order, its images wait behind those of hundreds of one-URL sites, and its backlog
ends the crawl. Each waiter comes with a head start, the seconds its source's queue needs at
its pace (``HEAD_START``, set by the scheduler), and the one whose arrival less its head start
is earliest goes next: none is passed by one that arrived more than the largest head start
after it (docs/decisions.md, "The pool's turns").
"""
from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Callable
from contextvars import ContextVar

# The running task's head start (seconds), asked when its image is ready: set by the scheduler.
HEAD_START: ContextVar[Callable[[], float] | None] = ContextVar("pool_head_start", default=None)


def head_start() -> float:
    """The running task's head start; 0 outside a scheduled task."""
    seconds = HEAD_START.get()
    return seconds() if seconds is not None else 0.0


class Turns:
    """At most ``size`` holders at once; the others wait, let in by arrival less head start."""

    def __init__(self, size: int, clock: Callable[[], float] = time.monotonic):
        self._free = size
        self._clock = clock
        self._waiting: list[tuple[float, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, turn in self._waiting if not turn.done())

    @contextlib.asynccontextmanager
    async def turn(self, head_start: float = 0.0) -> AsyncIterator[None]:
        await self._take(head_start)
        try:
            yield
        finally:
            self._give_back()

    async def _take(self, head_start: float) -> None:
        if self._free > 0:  # free only while nobody waits: a give-back hands its turn on first
            self._free -= 1
            return
        turn = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (self._clock() - max(head_start, 0.0), next(self._arrivals), turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # handed the turn, then cancelled: hand it on
                self._give_back()
            raise

    def _give_back(self) -> None:
        while self._waiting:
            _, _, turn = heapq.heappop(self._waiting)
            if not turn.done():  # a cancelled waiter's turn is left where it lies
                turn.set_result(None)
                return
        self._free += 1
