"""Each source's state as Redis holds it: counters, limits, halts.

Read by the dashboard's ``/metrics`` and ``/status`` and by ``python -m crawl_monitor.ctl``,
so the operator's CLI does not import the web server to read it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from redis.asyncio import Redis

from common.contracts import (adaptive_key, adaptive_off_key, error_statuses_key, errors_key, override_rate_key,
                              rate_limit_key, resized_key, source_requests_key, tokens_key)
from common.redis_values import as_text, count, finite_number
from common.source_sets import read_source_sets


@dataclass
class SourceState:
    """One source as Redis sees it now; shared by /metrics, /status and ``ctl status``."""
    requests: int = 0
    successes: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    rate_limit: float | None = None
    override: float | None = None
    tokens: int | None = None
    halted: bool = False
    temp_halted: bool = False
    # The adaptive back-off (adaptive:{source}): the limit it works under (computed or
    # overridden), what it allows of it, and the response times it judges by.
    ceiling: float | None = None
    effective_rate: float | None = None
    baseline_ms: float | None = None
    recent_ms: float | None = None
    adaptive: bool = True  # False while adaptive_off:{source} is set

    @property
    def error_total(self) -> int:
        return sum(self.errors.values())



async def _read_errors(redis: Redis, sources: list[str]) -> dict[str, dict[str, int]]:
    """Failures by status, from keys it can name: each source's ``error_statuses`` set
    says which counters exist (a SCAN would walk every key, one per robots.txt host too)."""
    pipe = redis.pipeline(transaction=False)
    for source in sources:
        pipe.smembers(error_statuses_key(source))
    statuses = [sorted(map(as_text, members)) for members in await pipe.execute()]
    keys = [errors_key(source, status) for source, named in zip(sources, statuses, strict=True) for status in named]
    values = iter(await redis.mget(keys) if keys else [])
    return {source: {status: count(next(values)) for status in named}
            for source, named in zip(sources, statuses, strict=True)}


def _whole(number: float | None) -> int | None:
    return None if number is None else int(number)


async def read_sources(redis: Redis) -> dict[str, SourceState]:
    """Every source in ``inbound_sources`` with its counters, limits and halts."""
    sets = await read_source_sets(redis)
    sources, halted, temp_halted = sorted(sets.inbound), sets.halted, sets.temp_halted
    pipe = redis.pipeline(transaction=False)
    for source in sources:
        for key in (source_requests_key(source), resized_key(source), rate_limit_key(source),
                    override_rate_key(source), tokens_key(source)):
            pipe.get(key)
        pipe.get(adaptive_off_key(source))
        pipe.hgetall(adaptive_key(source))
    values = await pipe.execute()
    errors = await _read_errors(redis, sources)
    states = {}
    for i, source in enumerate(sources):
        requests, successes, rate, override, tokens, off, adaptive = values[7 * i:7 * i + 7]
        adapted = {as_text(k): finite_number(v) for k, v in (adaptive or {}).items()}
        states[source] = SourceState(
            requests=count(requests), successes=count(successes),
            errors=errors[source],
            rate_limit=finite_number(rate), override=finite_number(override),
            tokens=_whole(finite_number(tokens)),
            halted=source in halted, temp_halted=source in temp_halted,
            ceiling=adapted.get("ceiling"), effective_rate=adapted.get("effective_rate"),
            baseline_ms=adapted.get("baseline_ms"), recent_ms=adapted.get("recent_ms"), adaptive=off is None,
        )
    return states
