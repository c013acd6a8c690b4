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
from worker.fetching.http_client import HttpClient
from worker.politeness import RequestGate
from worker.politeness.addresses import AddressGuard, Resolve, system_resolve
from worker.politeness.crawl_delay import CrawlDelay
from worker.politeness.host_limits import HostLimiter
from worker.politeness.retry_after import extend_pause, pause_seconds
from worker.politeness.consent import ResponseConsent
from worker.politeness.robots import RobotsCache, fetch_robots, origin_of, product_token
from worker.politeness.tdmrep import TdmRepCache, fetch_tdmrep


@dataclass
class PoliteGate:
    """Address guard, robots.txt, per-host cap, Crawl-delay and Retry-After."""

    redis: AsyncRedis
    guard: AddressGuard
    robots: RobotsCache
    limiter: HostLimiter
    delay: CrawlDelay
    clock: Callable[[], float] = time.time
    tdmrep: TdmRepCache | None = None  # None: CONSENT_TDMREP=false

    async def before_request(self, url: str, source: str) -> None:
        await self.guard.check(url)
        origin = origin_of(url)
        await self.robots.check(url, origin)
        if self.tdmrep is not None:
            await self.tdmrep.check(url, origin)

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


def build_gate(settings, redis, client: HttpClient, resolve: Resolve = system_resolve) -> RequestGate:
    """The gate for a worker: ``redis`` is a redis.asyncio client, ``client`` the one that
    fetches the images (robots.txt and tdmrep.json share its connections and User-Agent);
    ``resolve`` is for tests that need a hostname to look public."""
    guard = AddressGuard(enabled=not settings.crawl_allow_private_networks, resolve=resolve)
    token = product_token(settings.crawl_user_agent)
    categories = settings.content_usage_categories if settings.consent_content_usage else ()
    robots = RobotsCache(redis, partial(fetch_robots, client, guard=guard), token,
                         memory_bytes=settings.robots_cache_bytes, extra_tokens=settings.robots_extra_tokens,
                         categories=categories)
    tdmrep = None
    if settings.consent_tdmrep:
        tdmrep = TdmRepCache(redis, partial(fetch_tdmrep, client, guard=guard), token,
                             memory_bytes=settings.robots_cache_bytes)
    return PoliteGate(redis, guard, robots, HostLimiter(settings.crawl_per_host_connections),
                      CrawlDelay(redis), tdmrep=tdmrep)


def response_consent(settings) -> ResponseConsent:
    """The judge of a response's head (X-Robots-Tag, tdm-reservation, Content-Usage) for a worker."""
    return ResponseConsent(
        tokens=(product_token(settings.crawl_user_agent), *settings.robots_extra_tokens),
        directives=frozenset(settings.x_robots_tag_opt_out), x_robots_tag=settings.consent_x_robots_tag,
        tdmrep=settings.consent_tdmrep, content_usage=settings.consent_content_usage,
        categories=settings.content_usage_categories)
