"""Redis's clock as this process reads it: the one clock of the activity scores.

Workers score ``active_sources`` and ``waiting_sources`` by it and the monitor reads them by it,
so a reader needs slack only for a round trip, not for the fleet's clocks, and a source drops
out of the monitor's ticks within seconds of its last sign of work (docs/decisions.md, "Fleet
scale"). ``now`` is the local clock plus an offset measured with ``TIME`` every
``CLOCK_SYNC_SECONDS``: the offset of the quickest of ``CLOCK_SYNC_SAMPLES`` round trips, whose
error is at most half of it.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from common.contracts import EVENT_CLOCK_SYNC_FAILED
from common.jsonlog import log_event
from common.protocols import AsyncRedis

CLOCK_SYNC_SECONDS = 60.0  # a clock drifts ~50 ppm: 3 ms a minute
CLOCK_SYNC_SAMPLES = 3


def offset_of(before: float, redis_time: tuple[int, int], after: float) -> float:
    """Redis's time minus the local clock's, at the middle of a round trip from ``before`` to ``after``."""
    seconds, micros = redis_time
    return seconds + micros / 1e6 - (before + after) / 2


class RedisClock:
    def __init__(self, local: Callable[[], float] = time.time):
        self._local = local
        self.offset = 0.0  # until the first sync: the local clock

    def now(self) -> float:
        """Unix time by Redis's clock."""
        return self._local() + self.offset

    async def sync(self, redis: AsyncRedis) -> None:
        """Measure the offset; a failure is logged and the last offset kept (with Redis away
        nothing is scored or granted anyway)."""
        best: tuple[float, float] | None = None  # (round trip, offset)
        try:
            for _ in range(CLOCK_SYNC_SAMPLES):
                before = self._local()
                answer = await redis.time()
                after = self._local()
                if best is None or after - before < best[0]:
                    best = (after - before, offset_of(before, answer, after))
        except Exception as exc:  # noqa: BLE001 - a process must not stop on it
            log_event(EVENT_CLOCK_SYNC_FAILED, error=repr(exc)[:300], offset=round(self.offset, 6))
            return
        assert best is not None
        self.offset = best[1]

    async def keep_synced(self, redis: AsyncRedis) -> None:
        """Sync every CLOCK_SYNC_SECONDS until cancelled."""
        while True:
            await asyncio.sleep(CLOCK_SYNC_SECONDS)
            await self.sync(redis)
