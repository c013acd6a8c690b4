"""The three source sets every component reads: one round trip, one spelling."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.contracts import HALTED, INBOUND_SOURCES, TEMP_HALTED
from common.redis_values import as_text


@dataclass(frozen=True)
class SourceSets:
    inbound: frozenset[str]      # every source the splitter has seen
    halted: frozenset[str]       # stopped by the breaker until an operator resumes them
    temp_halted: frozenset[str]  # paused for a surge of errors

    @property
    def stopped(self) -> frozenset[str]:
        return self.halted | self.temp_halted


async def read_halts(redis: Any) -> SourceSets:
    """``halted`` and ``temp_halted`` alone (``inbound`` left empty): what a worker needs every
    few seconds, without ``inbound_sources``, which holds every source ever split (millions)."""
    pipe = redis.pipeline(transaction=False)
    for key in (HALTED, TEMP_HALTED):
        pipe.smembers(key)
    halted, temp_halted = (frozenset(as_text(m) for m in reply) for reply in await pipe.execute())
    return SourceSets(frozenset(), halted, temp_halted)


async def read_source_sets(redis: Any) -> SourceSets:
    """``inbound_sources``, ``halted`` and ``temp_halted`` as text, in one pipeline."""
    pipe = redis.pipeline(transaction=False)
    for key in (INBOUND_SOURCES, HALTED, TEMP_HALTED):
        pipe.smembers(key)
    replies = await pipe.execute()
    inbound, halted, temp_halted = (frozenset(as_text(m) for m in reply) for reply in replies)
    return SourceSets(inbound, halted, temp_halted)

