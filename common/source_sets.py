"""The three source sets every component reads: one round trip, one spelling."""
from __future__ import annotations

import asyncio
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


async def read_source_sets(redis: Any, inbound: bool = True) -> SourceSets:
    """``inbound_sources``, ``halted`` and ``temp_halted`` as text, in one pipeline; with
    ``inbound=False`` the first is left out (empty): at 100,000 sources it is big."""
    pipe = redis.pipeline(transaction=False)
    for key in (INBOUND_SOURCES, HALTED, TEMP_HALTED) if inbound else (HALTED, TEMP_HALTED):
        pipe.smembers(key)
    replies = await pipe.execute()
    if not inbound:
        replies = [set(), *replies]
    everyone, halted, temp_halted = (frozenset(as_text(m) for m in reply) for reply in replies)
    return SourceSets(everyone, halted, temp_halted)



async def stopped_among(redis: Any, sources: list[str]) -> tuple[frozenset[str], frozenset[str]]:
    """Which of ``sources`` are halted and which temporarily halted, by SMISMEMBER: a reply the
    size of ``sources`` (the active ones), not of every halt ever made."""
    if not sources:
        return frozenset(), frozenset()
    # Both at once; with ``common.redis_client``'s client, on its pipelined connection (one write).
    halted, temp_halted = await asyncio.gather(redis.smismember(HALTED, sources),
                                               redis.smismember(TEMP_HALTED, sources))
    return (frozenset(s for s, member in zip(sources, halted, strict=True) if member),
            frozenset(s for s, member in zip(sources, temp_halted, strict=True) if member))
