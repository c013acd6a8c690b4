"""Each source's state as Redis holds it: counters, limits, halts.

Read by the dashboard's ``/metrics`` and ``/status`` and by ``python -m crawl_monitor.ctl``,
so the operator's CLI does not import the web server to read it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from redis.asyncio import Redis

from common.contracts import (errors_key, override_rate_key, rate_limit_key, resized_key,
                              source_requests_key, tokens_key)
from common.numbers import count, finite_number
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

    @property
    def error_total(self) -> int:
        return sum(self.errors.values())


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def _read_errors(redis: Redis, sources: list[str]) -> dict[str, dict[str, int]]:
    """Failures by status: one SCAN for all sources, since SCAN walks the whole
    keyspace whatever it matches. Statuses never contain ':'."""
    owner = {errors_key(source): source for source in sources}
    keys = [_text(k) async for k in redis.scan_iter(match=errors_key("*", "*"), count=1000)]
    keys = sorted(k for k in keys if k.rpartition(":")[0] in owner)
    errors: dict[str, dict[str, int]] = {source: {} for source in sources}
    for key, value in zip(keys, await redis.mget(keys) if keys else []):
        prefix, _, status = key.rpartition(":")
        errors[owner[prefix]][status] = count(value)
    return errors


async def read_sources(redis: Redis) -> dict[str, SourceState]:
    """Every source in ``inbound_sources`` with its counters, limits and halts."""
    sets = await read_source_sets(redis)
    sources, halted, temp_halted = sorted(sets.inbound), sets.halted, sets.temp_halted
    pipe = redis.pipeline(transaction=False)
    for source in sources:
        for key in (source_requests_key(source), resized_key(source), rate_limit_key(source),
                    override_rate_key(source), tokens_key(source)):
            pipe.get(key)
    values = await pipe.execute()
    errors = await _read_errors(redis, sources)
    states = {}
    for i, source in enumerate(sources):
        requests, successes, rate, override, tokens = values[5 * i:5 * i + 5]
        states[source] = SourceState(
            requests=count(requests), successes=count(successes),
            errors=errors[source],
            rate_limit=finite_number(rate), override=finite_number(override),
            tokens=None if finite_number(tokens) is None else int(finite_number(tokens)),
            halted=source in halted, temp_halted=source in temp_halted,
        )
    return states
