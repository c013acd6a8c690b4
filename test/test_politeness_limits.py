"""Per-host cap and Crawl-delay turns, driven directly."""
from __future__ import annotations

import asyncio

import pytest

from common.contracts import crawl_delay_key
from worker.politeness.crawl_delay import LEASE_SECONDS, CrawlDelay
from worker.politeness.host_limits import HostLimiter

pytestmark = pytest.mark.paced  # runs by itself, after the rest (pytest.ini)


async def test_host_limiter_caps_each_host_and_forgets_idle_ones():
    limiter, peak, running = HostLimiter(2), {"a": 0, "b": 0}, {"a": 0, "b": 0}

    async def request(host: str) -> None:
        async with limiter.slot(host):
            running[host] += 1
            peak[host] = max(peak[host], running[host])
            await asyncio.sleep(0.01)
            running[host] -= 1

    await asyncio.gather(*(request(h) for h in "ab" * 6))
    assert peak == {"a": 2, "b": 2}
    assert limiter.in_use("a") == 0 and limiter.hosts() == 0


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


async def test_turn_holds_a_lease_then_spaces_by_the_delay(redis_client):
    clock = Clock(1_000_000.0)
    delay = CrawlDelay(redis_client, clock)
    key = crawl_delay_key("http://slow.example:80")
    async with delay.turn("http://slow.example:80", 5):
        assert float(await redis_client.get(key)) == pytest.approx(clock.now + LEASE_SECONDS)
        clock.now += 1  # the request took a second
    assert float(await redis_client.get(key)) == pytest.approx(1_000_006.0)


async def test_turn_is_released_when_the_request_fails(redis_client):
    clock = Clock(2_000_000.0)
    with pytest.raises(RuntimeError):
        async with CrawlDelay(redis_client, clock).turn("http://x:80", 2):
            raise RuntimeError("connection reset")
    assert float(await redis_client.get(crawl_delay_key("http://x:80"))) == pytest.approx(2_000_002.0)


async def test_no_delay_touches_nothing(redis_client):
    async with CrawlDelay(redis_client).turn("http://fast:80", 0):
        pass
    assert await redis_client.keys("*") == []
