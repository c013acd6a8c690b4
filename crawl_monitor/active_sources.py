"""The sources with outcomes lately (``active_sources``), and those with URLs split or tasks
waiting for their tokens (``waiting_sources``), so per-second work skips the quiet ones.

Reading every source ever seen (response buckets, breaker windows, counters) each
second, for the few hundred being crawled, would take the monitor's whole loop
(docs/decisions.md, "Thousands of sources"). A source with no outcome since a reader last looked has nothing new for it:
its windows only age, and its response buckets stay empty.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from common.contracts import ACTIVE_SOURCES, WAITING_SOURCES
from common.protocols import AsyncRedis
from common.redis_values import as_text
from crawl_monitor.constants import (ACTIVE_SOURCES_FULL_READ_SECONDS, ACTIVE_SOURCES_KEPT_SECONDS,
                                     ACTIVE_SOURCES_SLACK_SECONDS)


async def active_since(redis: AsyncRedis, since: float) -> set[str]:
    """Sources with an outcome at or after ``since`` (Unix time, as workers score them)."""
    return {as_text(member) for member in await redis.zrangebyscore(ACTIVE_SOURCES, since, "+inf")}


# KEYS: a sorted set; ARGV: the lowest score and, for the latest only, how many. Its members from there
# (with a count: the latest first), each followed by its score (text): redis-py's WITHSCORES reply
# re-encodes each score to bytes and casts it back, most of a read of many.
SCORED_SINCE = """
if ARGV[2] then
  return redis.call('ZREVRANGEBYSCORE', KEYS[1], '+inf', ARGV[1], 'WITHSCORES', 'LIMIT', 0, ARGV[2])
end
return redis.call('ZRANGEBYSCORE', KEYS[1], ARGV[1], '+inf', 'WITHSCORES')
"""


async def active_since_each(redis: AsyncRedis, sinces: list[float]) -> list[set[str]]:
    """``active_since`` for each of ``sinces``, in one round trip."""
    async with redis.pipeline(transaction=False) as pipe:
        for since in sinces:
            pipe.zrangebyscore(ACTIVE_SOURCES, since, "+inf")
        replies = await pipe.execute()
    return [{as_text(member) for member in reply} for reply in replies]


async def _scored_since(redis: AsyncRedis, key: str, since: float, most: int | None = None) -> dict[str, float]:
    flat = iter(await redis.register_script(SCORED_SINCE)(keys=[key], args=[since] if most is None else [since, most]))
    return {as_text(member): float(score) for member, score in zip(flat, flat, strict=True)}


async def active_scores(redis: AsyncRedis, since: float) -> dict[str, float]:
    """Sources active at or after ``since`` with the time of their latest activity."""
    return await _scored_since(redis, ACTIVE_SOURCES, since)


async def wanting_scores(redis: AsyncRedis, since: float, most: int | None = None) -> dict[str, float]:
    """Sources with an outcome, a split or a task waiting for tokens at or after ``since``
    (``active_sources`` and ``waiting_sources``), with the time of their latest one; with ``most``,
    only the ``most`` latest of each set (so at least the ``most`` latest of both)."""
    active, waiting = await asyncio.gather(*(_scored_since(redis, key, since, most)
                                             for key in (ACTIVE_SOURCES, WAITING_SOURCES)))
    scores = dict(waiting)
    for source, score in active.items():
        scores[source] = max(score, scores.get(source, score))
    return scores


async def wanting_since(redis: AsyncRedis, since: float) -> set[str]:
    """``wanting_scores`` without the times (parsing them was most of a read of many)."""
    async with redis.pipeline(transaction=False) as pipe:
        for key in (ACTIVE_SOURCES, WAITING_SOURCES):
            pipe.zrangebyscore(key, since, "+inf")
        active, waiting = await pipe.execute()
    return {as_text(member) for member in (*active, *waiting)}


async def forget_quiet(redis: AsyncRedis, now: float) -> None:
    """Drop the sources quiet for a day: the sets then hold the sources of a day's crawl."""
    async with redis.pipeline(transaction=False) as pipe:
        for key in (ACTIVE_SOURCES, WAITING_SOURCES):
            pipe.zremrangebyscore(key, "-inf", f"({now - ACTIVE_SOURCES_KEPT_SECONDS}")
        await pipe.execute()


class Rereads:
    """Which sources a periodic reader reads again: those with an outcome, a split or a task
    waiting for tokens since its last read, or every one it shows each
    ``ACTIVE_SOURCES_FULL_READ_SECONDS``, so what changes without an outcome (an operator's
    override, a saved adaptive state) shows within that time."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self._clock = clock
        self._last_read = float("-inf")
        self._next_full_read = float("-inf")

    async def due(self, redis: AsyncRedis) -> set[str] | None:
        """The sources with news since the last call, or None when every source is due (a full read)."""
        now = self._clock()
        since, self._last_read = self._last_read - ACTIVE_SOURCES_SLACK_SECONDS, now
        if now >= self._next_full_read:
            self._next_full_read = now + ACTIVE_SOURCES_FULL_READ_SECONDS
            return None
        return await wanting_since(redis, since)
