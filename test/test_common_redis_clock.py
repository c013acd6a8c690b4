"""Redis's clock (common.redis_clock): the activity scores' one clock, with a fake and the real server."""
from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from common.contracts import WAITING_SOURCES, override_rate_key, tokens_key
from common.redis_clock import RedisClock, offset_of
from crawl_monitor.regulator import Regulator
from worker.fetching.tokens import TokenBuckets


@pytest.mark.parametrize("before, redis_time, after, offset", [
    (100.0, (100, 0), 100.0, 0.0),              # the same clock
    (100.0, (130, 500_000), 100.2, 30.4),       # Redis 30.4 s ahead, read mid-way through 0.2 s
    (100.0, (69, 900_000), 100.2, -30.2),       # this clock 30.2 s ahead
])
def test_the_offset_is_redis_time_at_the_middle_of_the_round_trip(before, redis_time, after, offset) -> None:
    assert offset_of(before, redis_time, after) == pytest.approx(offset)


class _SlowTime:
    """TIME answers, each taking a given round trip on a local clock that the fake moves."""

    def __init__(self, local: list[float], answers: list[tuple[float, tuple[int, int]]]):
        self._local, self._answers = local, answers

    async def time(self) -> tuple[int, int]:
        round_trip, answer = self._answers.pop(0)
        self._local[0] += round_trip
        return answer


async def test_a_sync_keeps_the_quickest_round_trip_and_a_failure_keeps_the_last_offset(capsys) -> None:
    local = [1000.0]
    clock = RedisClock(local=lambda: local[0])
    # Redis is 50 s ahead; the slow round trips' answers came late in them, the quick one is true.
    slow = _SlowTime(local, [(0.4, (1050, 390_000)), (0.002, (1050, 401_000)), (0.3, (1050, 700_000))])
    await clock.sync(slow)  # type: ignore[arg-type]
    assert clock.offset == pytest.approx(50.0, abs=0.002)
    assert clock.now() == pytest.approx(local[0] + 50.0)
    await clock.sync(_SlowTime(local, []))  # type: ignore[arg-type]  # IndexError: Redis "away"
    assert clock.offset == pytest.approx(50.0, abs=0.002)
    assert '"event": "clock_sync_failed"' in capsys.readouterr().out


async def test_a_worker_whose_clock_is_a_minute_behind_still_gets_its_tokens(redis_url: str, unique: str) -> None:
    """The regulator grants tokens to the sources scored in the last seconds by Redis's clock:
    a worker a minute behind, scoring by its own clock, would never be granted any; by
    RedisClock it is, at once."""
    redis = aioredis.Redis.from_url(redis_url, decode_responses=True)
    source = f"behind-{unique}"
    await redis.set(override_rate_key(source), 5)
    regulator = Regulator(redis)
    monitor_clock = RedisClock()
    await monitor_clock.sync(redis)

    async def waits_then_granted(worker: RedisClock) -> bool:
        """A task of a worker on ``worker``'s clock waits for the source's tokens: granted at the next tick?"""
        tokens = TokenBuckets(redis, clock=worker.now)
        await redis.zrem(WAITING_SOURCES, source)
        waiter = asyncio.create_task(tokens.until_available(source))
        for _ in range(100):  # until its wait is scored
            if await redis.zscore(WAITING_SOURCES, source) is not None:
                break
            await asyncio.sleep(0.01)
        grants = await regulator.tick(monitor_clock.now())
        if grants.get(source) == 5:
            assert await redis.get(tokens_key(source)) == "5"
            await asyncio.wait_for(waiter, 2)
        tokens.close()
        await asyncio.gather(waiter, return_exceptions=True)
        return grants.get(source) == 5

    try:
        behind = RedisClock(local=lambda: time.time() - 60)
        assert not await waits_then_granted(behind)  # by its own clock
        await behind.sync(redis)
        assert await waits_then_granted(behind)      # by Redis's
    finally:
        await redis.aclose()
