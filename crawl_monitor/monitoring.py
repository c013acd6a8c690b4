"""The ``monitoring_update`` log line (SPEC.md §4): the crawl's state every 5 seconds.

Totals are read from the counters workers and the splitter keep in Redis;
rates are the change of those totals over the interval since the last line.
Each source's ``effective_rate`` and ``response_ms`` come from the adaptive back-off's
``adaptive:{source}`` (``crawl_monitor.adaptive``).
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any
from collections.abc import Callable

from common import contracts
from common.jsonlog import log_event
from common.source_sets import read_source_sets
from common.redis_values import as_text, count, finite_number
from common.protocols import AsyncRedis
from crawl_monitor.active_sources import Rereads

_TOTALS = (contracts.NUM_RESIZED, contracts.RESIZE_ERRORS, contracts.NUM_SPLIT)


class MonitoringLog:
    """Builds and logs each update; ``latest`` holds the last one for the dashboard."""

    def __init__(self, redis: AsyncRedis, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self._redis = redis
        self._clock = clock
        self._previous: tuple[float, dict[str, int]] | None = None
        self.latest: dict[str, Any] | None = None
        self._rereads = Rereads(wall_clock)
        self._specific: dict[str, dict[str, Any]] = {}  # source -> its counters as last read

    async def update(self) -> dict[str, Any]:
        """Read the counters, log one ``monitoring_update`` and return it."""
        raw_totals = await self._redis.mget(list(_TOTALS))
        sets = await read_source_sets(self._redis)
        inbound, halted, temp_halted = sets.inbound, sets.halted, sets.temp_halted
        now = self._clock()
        totals = dict(zip(_TOTALS, map(count, raw_totals), strict=True))
        sources = sorted(inbound)
        specific = await self._per_source(sources)

        previous_at, previous = self._previous or (now, totals)
        self._previous = (now, totals)
        elapsed = now - previous_at

        def rate(name: str) -> float:
            # A counter that went down (Redis flushed) restarts the count rather than going negative.
            if elapsed <= 0:
                return 0.0
            return round(max(0, totals[name] - previous[name]) / elapsed, 3)

        general = {
            "global_max_rps": round(sum(s["rate_limit"] for s in specific.values()), 3),
            "error_rps": rate(contracts.RESIZE_ERRORS),
            "processing_rate": round(rate(contracts.NUM_RESIZED) + rate(contracts.RESIZE_ERRORS), 3),
            "success_rps": rate(contracts.NUM_RESIZED),
            "circuit_breaker_tripped": sorted(set(halted) | set(temp_halted)),
            # These two fields are named after the counters they report (SPEC.md §4).
            contracts.NUM_RESIZED: totals[contracts.NUM_RESIZED],
            contracts.RESIZE_ERRORS: totals[contracts.RESIZE_ERRORS],
            "split_rate": rate(contracts.NUM_SPLIT),
        }
        self.latest = log_event(contracts.EVENT_MONITORING_UPDATE, general=general, specific=specific)
        return self.latest

    async def _per_source(self, sources: list[str]) -> dict[str, dict[str, Any]]:
        """Each source's counters; only the sources ``Rereads`` names are read again, the rest
        are as last read with this second's rate limit (one MGET): at 5,000 sources, reading
        them all every 5 s was a sixth of the monitor's time (issue 20)."""
        if not sources:
            return {}
        due = sorted(await self._rereads.due(self._redis, sources, self._specific))
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.mget([contracts.rate_limit_key(source) for source in sources])
            for source in due:
                pipe.get(contracts.resized_key(source))
                pipe.get(contracts.errors_key(source))
                pipe.lrange(contracts.last_50_key(source), 0, -1)
                pipe.hgetall(contracts.adaptive_key(source))
            rate_limits, *replies = await pipe.execute()
        for index, source in enumerate(due):
            successful, error, last_50, adaptive = replies[index * 4:(index + 1) * 4]
            self._specific[source] = {
                "successful": count(successful),
                "error": count(error),
                "last_50_statuses": dict(Counter(last_50)),
                **adaptive_view(adaptive or {}),
            }
        self._specific = {source: self._specific[source] for source in sources}  # forget the removed ones
        return {source: {**self._specific[source], "rate_limit": finite_number(rate_limit) or 0.0}
                for source, rate_limit in zip(sources, rate_limits, strict=True)}


def adaptive_view(raw: dict) -> dict[str, Any]:
    """``effective_rate`` (what the adaptive back-off allows, req/s; None before its first
    verdict) and ``response_ms`` {baseline, recent} from ``adaptive:{source}``."""
    values = {as_text(k): finite_number(v) for k, v in raw.items()}
    return {"effective_rate": values.get("effective_rate"),
            "response_ms": {"baseline": values.get("baseline_ms"), "recent": values.get("recent_ms")}}
