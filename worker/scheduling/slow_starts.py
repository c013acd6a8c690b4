"""How many URLs of its slow sources a worker starts a second while it is short of CPU.

asyncio runs the ready callbacks one after the other, so when the event loop is
busy every task waits the same delay between its steps. A slow source loses
nothing to that: it needs a token every few seconds. A fast one loses tokens:
its turns pass one token every few rounds of the loop, so beside thousands of
slow sources it falls far below its limit, and its backlog, the longest, ends
the crawl later (docs/decisions.md, "One keyed urls topic, and parking").

So fast sources come first. While a source paced at FAST_SOURCE_RATE or more
has work here, the slow sources' starts are held to what leaves the loop on
time: the loop's delay is probed every LOOP_LAG_PROBE_SECONDS, and once a
second the slow sources' allowance falls by a factor while the delay's mean is
over LOOP_LAG_TARGET, and climbs while it is under. It never falls below what
the slow sources here ask (the sum of their paces) or SLOW_SHARE of the URLs the
worker ends a second, whichever is less, nor below SLOW_STARTS_FLOOR: a few
slow sources beside fast ones (the demo's 1-3 req/s sites) are not held at all,
and thousands keep a share, taken in the scheduler's rotation, so no slow
source starves. With no fast source working here nothing is limited: sources
alike in pace share the loop as before.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from common.contracts import EVENT_WORKER_SLOW_SOURCES_HELD
from common.jsonlog import log_event
from worker.constants import (ADMISSION_REPORT_SECONDS, ADMISSION_UPDATE_SECONDS, LOOP_LAG_PROBE_SECONDS,
                              LOOP_LAG_TARGET, SLOW_SHARE, SLOW_STARTS_BURST_SECONDS, SLOW_STARTS_DECREASE,
                              SLOW_STARTS_FLOOR, SLOW_STARTS_INCREASE)


class Admission:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.limit: float | None = None  # slow sources' starts a second; None: not limited
        self._allowance = 0.0
        self._refilled_at = clock()
        self._started = 0            # slow starts since the last update
        self._ended = 0              # tasks ended since the last update, every source's
        self._lag_total = 0.0
        self._lag_samples = 0
        self._updated_at = clock()
        self._reported_at = float("-inf")

    def may_start_slow(self) -> bool:
        if self.limit is None:
            return True
        now = self._clock()
        burst = max(1.0, self.limit * SLOW_STARTS_BURST_SECONDS)
        self._allowance = min(self._allowance + (now - self._refilled_at) * self.limit, burst)
        self._refilled_at = now
        return self._allowance >= 1.0

    def started_slow(self) -> None:
        self._started += 1
        self._allowance -= 1.0

    def ended(self) -> None:
        self._ended += 1

    def lagged(self, seconds: float) -> None:
        """One probe's delay: how late the loop ran a timer."""
        self._lag_total += max(0.0, seconds)
        self._lag_samples += 1

    def probed(self) -> tuple[int, float]:
        """The loop's probes since the last update: how many, and their summed delay (s)."""
        return self._lag_samples, self._lag_total

    def update(self, fast_working: bool, slow_demand: float) -> None:
        """At most once per ADMISSION_UPDATE_SECONDS: the slow sources' allowance for the next one,
        from the loop's mean delay since the last update and the slow starts made in it;
        ``slow_demand``: the summed paces of the slow sources with work here."""
        now = self._clock()
        elapsed = now - self._updated_at
        if elapsed < ADMISSION_UPDATE_SECONDS:
            return
        samples, total = self.probed()
        lag = total / samples if samples else 0.0
        started, ended = self._started / elapsed, self._ended / elapsed
        self._updated_at, self._started, self._ended, self._lag_total, self._lag_samples = now, 0, 0, 0.0, 0
        floor = max(SLOW_STARTS_FLOOR, min(slow_demand, SLOW_SHARE * ended))
        was = self.limit
        if not fast_working:
            self.limit = None
        elif lag > LOOP_LAG_TARGET:
            # From what was started, not from an allowance that went unused.
            base = started if self.limit is None else min(self.limit, started)
            self.limit = max(floor, base * SLOW_STARTS_DECREASE)
        elif self.limit is not None:
            self.limit = max(floor, self.limit * SLOW_STARTS_INCREASE + 1.0)
        if self.limit is not None and was is None:
            self._allowance, self._refilled_at = 0.0, now
        if (self.limit is None) != (was is None) or (
                self.limit is not None and now - self._reported_at >= ADMISSION_REPORT_SECONDS):
            self._reported_at = now
            log_event(EVENT_WORKER_SLOW_SOURCES_HELD,
                      starts_per_second=None if self.limit is None else round(self.limit, 1),
                      loop_lag_ms=round(lag * 1000, 1), slow_started_per_second=round(started, 1))

    async def probe_forever(self) -> None:
        """Measure the loop's delay on a timer, until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LOOP_LAG_PROBE_SECONDS
            await asyncio.sleep(LOOP_LAG_PROBE_SECONDS)
            self.lagged(loop.time() - due)
