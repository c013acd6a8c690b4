"""The worker's RequestGate: every politeness rule a request must pass, in
the order the fetcher calls them (see ``worker.politeness``)."""
from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Mapping
from urllib.parse import urlsplit

from common.contracts import EVENT_RETRY_AFTER_RECEIVED
from common.jsonlog import log_event
from worker.politeness import RequestGate
from worker.politeness.addresses import AddressGuard
from worker.politeness.host_limits import HostLimiter
from worker.politeness.retry_after import extend_pause, pause_seconds


class PoliteGate:
    """Address guard, robots.txt, per-host cap, Crawl-delay and Retry-After."""

    def __init__(self, redis, guard: AddressGuard, limiter: HostLimiter,
                 robots=None, clock: Callable[[], float] = time.time):
        self.redis = redis
        self.guard = guard
        self.limiter = limiter
        self.robots = robots
        self.clock = clock

    async def before_request(self, url: str, source: str) -> None:
        await self.guard.check(url)
        if self.robots is not None:
            await self.robots.check(url)

    @asynccontextmanager
    async def host_slot(self, url: str) -> AsyncIterator[None]:
        async with self.limiter.slot(urlsplit(url).hostname or ""):
            yield

    async def after_response(self, url: str, source: str, status: int,
                             headers: Mapping[str, str]) -> None:
        now = self.clock()
        seconds = pause_seconds(status, headers, now)
        if seconds is not None:
            until = await extend_pause(self.redis, source, seconds, now)
            log_event(EVENT_RETRY_AFTER_RECEIVED, source=source, url=url, status=status,
                      pause_seconds=seconds, until=until)


def build_gate(settings, redis, http_session) -> RequestGate:
    """The gate for a worker: ``redis`` is a redis.asyncio client, ``http_session``
    the crawler's aiohttp session (its User-Agent is sent for robots.txt too)."""
    guard = AddressGuard(enabled=not settings.crawl_allow_private_networks)
    return PoliteGate(redis, guard, HostLimiter(settings.crawl_per_host_connections))
