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

_TOTALS = (contracts.NUM_RESIZED, contracts.RESIZE_ERRORS, contracts.NUM_SPLIT)


class MonitoringLog:
    """Builds and logs each update; ``latest`` holds the last one for the dashboard."""

    def __init__(self, redis: AsyncRedis, clock: Callable[[], float] = time.monotonic):
        self._redis = redis
        self._clock = clock
        self._previous: tuple[float, dict[str, int]] | None = None
        self.latest: dict[str, Any] | None = None

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
        if not sources:
            return {}
        async with self._redis.pipeline(transaction=False) as pipe:
            for source in sources:
                pipe.get(contracts.resized_key(source))
                pipe.get(contracts.errors_key(source))
                pipe.lrange(contracts.last_50_key(source), 0, -1)
                pipe.get(contracts.rate_limit_key(source))
                pipe.hgetall(contracts.adaptive_key(source))
            replies = await pipe.execute()
        specific = {}
        for index, source in enumerate(sources):
            successful, error, last_50, rate_limit, adaptive = replies[index * 5:(index + 1) * 5]
            specific[source] = {
                "successful": count(successful),
                "error": count(error),
                "last_50_statuses": dict(Counter(last_50)),
                "rate_limit": finite_number(rate_limit) or 0.0,
                **adaptive_view(adaptive or {}),
            }
        return specific


def adaptive_view(raw: dict) -> dict[str, Any]:
    """``effective_rate`` (what the adaptive back-off allows, req/s; None before its first
    verdict) and ``response_ms`` {baseline, recent} from ``adaptive:{source}``."""
    values = {as_text(k): finite_number(v) for k, v in raw.items()}
    return {"effective_rate": values.get("effective_rate"),
            "response_ms": {"baseline": values.get("baseline_ms"), "recent": values.get("recent_ms")}}
