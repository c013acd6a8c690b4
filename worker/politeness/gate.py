"""The worker's RequestGate: every politeness rule a request must pass, in
the order the fetcher calls them (see ``worker.politeness``)."""
from __future__ import annotations

import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from collections.abc import AsyncIterator, Callable, Mapping

from common.contracts import EVENT_RETRY_AFTER_RECEIVED
from common.hosts import url_origin
from common.jsonlog import log_event
from common.protocols import AsyncRedis
from worker.politeness import RequestGate
from worker.politeness.addresses import AddressGuard, Resolve, system_resolve
from worker.politeness.crawl_delay import CrawlDelay
from worker.politeness.host_limits import HostLimiter
from worker.politeness.retry_after import extend_pause, pause_seconds
from worker.politeness.robots import RobotsCache, fetch_robots, origin_of, product_token


@dataclass
class PoliteGate:
    """Address guard, robots.txt, per-host cap, Crawl-delay and Retry-After."""

    redis: AsyncRedis
    guard: AddressGuard
    robots: RobotsCache
    limiter: HostLimiter
    delay: CrawlDelay
    clock: Callable[[], float] = time.time

    async def before_request(self, url: str, source: str) -> None:
        await self.guard.check(url)
        await self.robots.check(url)

    @asynccontextmanager
    async def host_slot(self, url: str) -> AsyncIterator[None]:
        origin = origin_of(url)
        async with self.limiter.slot(url_origin(url).host):
            rules = await self.robots.rules(origin)
            async with self.delay.turn(origin, rules.crawl_delay):
                yield

    async def after_response(self, url: str, source: str, status: int,
                             headers: Mapping[str, str]) -> None:
        now = self.clock()
        seconds = pause_seconds(status, headers, now)
        if seconds is not None:
            until = await extend_pause(self.redis, source, seconds, now)
            log_event(EVENT_RETRY_AFTER_RECEIVED, source=source, url=url, status=status,
                      pause_seconds=seconds, until=until)


def build_gate(settings, redis, http_session, resolve: Resolve = system_resolve) -> RequestGate:
    """The gate for a worker: ``redis`` is a redis.asyncio client, ``http_session``
    the crawler's aiohttp session (its User-Agent is sent for robots.txt too);
    ``resolve`` is for tests that need a hostname to look public."""
    guard = AddressGuard(enabled=not settings.crawl_allow_private_networks, resolve=resolve)
    robots = RobotsCache(redis, partial(fetch_robots, http_session, guard=guard),
                         product_token(settings.crawl_user_agent), memory_bytes=settings.robots_cache_bytes)
    return PoliteGate(redis, guard, robots, HostLimiter(settings.crawl_per_host_connections),
                      CrawlDelay(redis))
