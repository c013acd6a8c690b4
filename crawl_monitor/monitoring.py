"""The ``monitoring_update`` log line (SPEC.md §4): the crawl's state every 5 seconds.

Totals are read from the counters workers and the splitter keep in Redis;
rates are the change of those totals over the interval since the last line.
Each source's ``effective_rate`` and ``response_ms`` come from the adaptive back-off's
``adaptive:{source}`` (``crawl_monitor.adaptive``), its ``backlog`` from
``urls_split:{source}`` - ``urls_ended:{source}``.

A line lists the sources active in its interval (an outcome, a split, a worker waiting
for their tokens: ``active_sources``, ``waiting_sources``) and the halted and paused ones, and counts the rest
(``general.sources_total``, ``sources_listed``): a line of every source ever seen
would be megabytes, read every 5 s for sources with nothing going on. Even so, at
most ``MONITORING_MAX_LISTED`` sources are read and
``MONITORING_SPECIFIC_BYTES`` of them written (stopped ones first, then the most recently
active), and the halted names in ``circuit_breaker_tripped`` stop at
``MONITORING_TRIPPED_BYTES``, so one line stays under 256 KiB whatever the crawl.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any
from collections.abc import Callable, Iterable

from common import contracts
from common.jsonlog import log_event
from common.redis_values import as_text, count, finite_number
from common.protocols import AsyncRedis
from crawl_monitor.active_sources import wanting_scores
from crawl_monitor.batched_keys import BatchedKeys
from crawl_monitor.constants import (ACTIVE_SOURCES_SLACK_SECONDS, ACTIVE_SOURCES_TICK_SECONDS,
                                     MONITORING_INTERVAL_SECONDS, MONITORING_MAX_LISTED, MONITORING_SPECIFIC_BYTES,
                                     MONITORING_TRIPPED_BYTES)
from crawl_monitor.source_state import backlog, signal_counts

_TOTALS = (contracts.NUM_RESIZED, contracts.RESIZE_ERRORS, contracts.NUM_SPLIT)


class MonitoringLog:
    """Builds and logs each update; ``latest`` holds the last one for the dashboard."""

    def __init__(self, redis: AsyncRedis, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self._redis = redis
        self._keys = BatchedKeys(redis)
        self._clock = clock
        self._wall_clock = wall_clock
        self._previous: tuple[float, dict[str, int]] | None = None
        self._interval_start: float | None = None  # wall clock: where this line's interval begins
        self.latest: dict[str, Any] | None = None

    async def update(self) -> dict[str, Any]:
        """Read the counters, log one ``monitoring_update`` and return it."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.mget(list(_TOTALS))
            pipe.scard(contracts.INBOUND_SOURCES)
            pipe.smembers(contracts.HALTED)
            pipe.smembers(contracts.TEMP_HALTED)
            pipe.hgetall(contracts.OPTED_OUT)
            raw_totals, sources_total, halted, temp_halted, opted_out = await pipe.execute()
        stopped = {as_text(s) for s in halted} | {as_text(s) for s in temp_halted}
        now, wall = self._clock(), self._wall_clock()
        since = wall - MONITORING_INTERVAL_SECONDS if self._interval_start is None else self._interval_start
        self._interval_start = wall
        # Granted a rate now (the regulator's sources), and active in this line's interval (longer).
        recent = await wanting_scores(self._redis, min(wall - ACTIVE_SOURCES_TICK_SECONDS,
                                                       since - ACTIVE_SOURCES_SLACK_SECONDS))
        ticked = {s for s, at in recent.items() if at >= wall - ACTIVE_SOURCES_TICK_SECONDS}
        active = {s: at for s, at in recent.items() if at >= since - ACTIVE_SOURCES_SLACK_SECONDS}
        candidates = sorted(stopped | set(active), key=lambda s: (s not in stopped, -active.get(s, 0.0), s))
        candidates = candidates[:MONITORING_MAX_LISTED]
        rate_limits, read = await self._per_source(sorted(set(ticked) | set(candidates)), candidates)
        specific = _within(MONITORING_SPECIFIC_BYTES, ((s, {**read[s], "rate_limit": rate_limits[s]})
                                                        for s in candidates))

        totals = dict(zip(_TOTALS, map(count, raw_totals), strict=True))
        previous_at, previous = self._previous or (now, totals)
        self._previous = (now, totals)
        elapsed = now - previous_at

        def rate(name: str) -> float:
            # A counter that went down (Redis flushed) restarts the count rather than going negative.
            if elapsed <= 0:
                return 0.0
            return round(max(0, totals[name] - previous[name]) / elapsed, 3)

        general = {
            "global_max_rps": round(sum(rate_limits.values()), 3),
            "error_rps": rate(contracts.RESIZE_ERRORS),
            "processing_rate": round(rate(contracts.NUM_RESIZED) + rate(contracts.RESIZE_ERRORS), 3),
            "success_rps": rate(contracts.NUM_RESIZED),
            "circuit_breaker_tripped": list(_within(MONITORING_TRIPPED_BYTES, ((s, None) for s in sorted(stopped)))),
            # These two fields are named after the counters they report (SPEC.md §4).
            contracts.NUM_RESIZED: totals[contracts.NUM_RESIZED],
            contracts.RESIZE_ERRORS: totals[contracts.RESIZE_ERRORS],
            "split_rate": rate(contracts.NUM_SPLIT),
            # Every source the splitter has seen, those in ``specific``, and the halted or paused.
            "sources_total": count(sources_total),
            "sources_listed": len(specific),
            "sources_stopped": len(stopped),
            # URLs their sites opted out of, per signal (SPEC.md §1 opted_out), since the crawl began.
            "opted_out": signal_counts(opted_out),
        }
        self.latest = log_event(contracts.EVENT_MONITORING_UPDATE, general=general,
                                specific=dict(sorted(specific.items())))
        return self.latest

    async def _per_source(self, limited: list[str], listed: list[str]
                          ) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
        """The rate limits of ``limited`` (for ``global_max_rps``) and the counters of
        ``listed``: one MGET per counter kind, and its list and two hashes a listed source read
        by script (``batched_keys``), whatever the crawl."""
        if not limited:  # ``listed`` is among them
            return {}, {}
        counters = (contracts.urls_split_key, contracts.urls_ended_key, contracts.resized_key, contracts.errors_key)
        # At once, on the client's pipelined connection (redis-py's pipeline packed each key).
        rate_limits, *columns = await asyncio.gather(
            self._redis.mget([contracts.rate_limit_key(source) for source in limited]),
            *(self._redis.mget([key_of(source) for source in listed]) for key_of in counters if listed))
        split, ended, resized, errors = columns or [[] for _ in counters]
        last_50s = await self._keys.lists([contracts.last_50_key(source) for source in listed], 0, -1)
        hashes = await self._keys.hashes([contracts.adaptive_key(source) for source in listed]
                                         + [contracts.opted_out_key(source) for source in listed])
        adaptives, opted_outs = hashes[:len(listed)], hashes[len(listed):]
        read = {}
        for index, source in enumerate(listed):
            successful, error, last_50 = resized[index], errors[index], last_50s[index]
            adaptive, opted_out = adaptives[index], opted_outs[index]
            read[source] = {
                "successful": count(successful),
                "error": count(error),
                "last_50_statuses": dict(Counter(last_50)),
                **adaptive_view(adaptive or {}),
                "backlog": backlog(split[index], ended[index]),
                "opted_out": signal_counts(opted_out),
            }
        limits = {source: finite_number(value) or 0.0 for source, value in zip(limited, rate_limits, strict=True)}
        return limits, read


def _within(budget: int, entries: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """The leading entries whose JSON (``"name": value, ``) fits in ``budget`` bytes."""
    kept: dict[str, Any] = {}
    used = 0
    for name, value in entries:
        used += len(json.dumps({name: value}).encode()) + 2
        if used > budget:
            break
        kept[name] = value
    return kept


def adaptive_view(raw: dict) -> dict[str, Any]:
    """From ``adaptive:{source}`` (None before its first verdict): ``limit`` (the rate of its size,
    or its override), ``ceiling`` (the most it may be granted: the limit, or capacity discovery's
    ceiling), ``effective_rate`` (what the adaptive back-off allows now, req/s) and
    ``response_ms`` {baseline, recent}."""
    values = {as_text(k): finite_number(v) for k, v in raw.items()}
    return {"limit": values.get(contracts.ADAPTIVE_LIMIT_FIELD),
            "ceiling": values.get(contracts.ADAPTIVE_CEILING_FIELD),
            "effective_rate": values.get("effective_rate"),
            "response_ms": {"baseline": values.get("baseline_ms"), "recent": values.get("recent_ms")}}
