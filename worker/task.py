"""One URL from download to its single terminal outcome (SPEC.md §1).

Outcomes: a quality message (plus the EXIF message and the thumbnail) on
success; ``link_rot`` for 404 and 410; a retry through ``inbound_images``
for transient failures while attempts remain; ``crawl_errors`` for every
other end. A URL whose host's robots.txt cannot be had is no outcome yet: it
waits in a wait topic (``worker.waiting``) and comes back, up to
``ROBOTS_UNAVAILABLE_GIVE_UP`` after it first found robots.txt unavailable.
``process`` returns only once its outcome (or its wait) is acknowledged, so
the scheduler can commit the message's offset.

Failures of our own infrastructure (Kafka, S3, Redis) are never a URL's
outcome: the task waits them out (``persist``) and is cancelled, uncommitted,
if the worker stops first.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any, TypeVar
from collections.abc import Awaitable, Callable, Mapping

from redis.exceptions import RedisError

from common.contracts import EVENT_INFRA_RETRY
from common.contracts import (CRAWL_ERRORS_TOPIC, INBOUND_TOPIC, LINK_ROT_TOPIC, METADATA_TOPIC,
                              CrawlRequest, crawl_error_message, exif_message, link_rot_message,
                              quality_message)
from common.jsonlog import log_event
from common.settings import Settings
from common.statuses import Status, in_windows, is_retryable
from common.protocols import MessageProducer
from worker.constants import INFRA_RETRY_FIRST_DELAY, INFRA_RETRY_MAX_DELAY, LINK_ROT_STATUSES
from worker.fetch import Fetched, FetchError, Fetcher
from worker.imaging import Analysis
from worker.thumbnails import ThumbnailStore
from worker.shared_memory import Body, SegmentUnavailable
from worker.politeness.robots import product_token
from worker.politeness.robots_tag import applicable_directives, forbids_thumbnail
from worker.waiting import wait_message
from worker.stats import Stats

T = TypeVar("T")
Analyze = Callable[[Body, int], Awaitable[Analysis]]  # the body, the thumbnail's target size


async def persist(what: str, operation: Callable[[], Awaitable[T]],
                  retry_on: tuple[type[Exception], ...] = (Exception,)) -> T:
    """Run ``operation`` until it succeeds, backing off: for calls to our own infrastructure."""
    delay = INFRA_RETRY_FIRST_DELAY
    while True:
        try:
            return await operation()
        except retry_on as exc:
            log_event(EVENT_INFRA_RETRY, what=what, error=repr(exc)[:500], retry_in=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, INFRA_RETRY_MAX_DELAY)


class ImageTask:
    def __init__(self, fetcher: Fetcher, analyze: Analyze, thumbnails: ThumbnailStore,
                 producer: MessageProducer, stats: Stats,
                 settings: Settings):
        self._fetcher = fetcher
        self._analyze = analyze
        self._thumbnails = thumbnails
        self._producer = producer
        self._stats = stats
        self._target = settings.target_resolution
        self._max_retries = settings.max_retries
        self._agent_token = product_token(settings.crawl_user_agent)
        self._robots_give_up = settings.robots_unavailable_give_up

    async def process(self, request: CrawlRequest) -> float:
        """Crawl ``request`` to its outcome; returns the seconds of work (token waits excluded)."""
        started = time.monotonic()
        token_wait = 0.0
        try:
            # Tokens and robots.txt live in Redis; a body needs memory for its segment.
            fetched = await persist("fetch_infrastructure",
                                    lambda: self._fetcher.fetch(request.url, request.source),
                                    retry_on=(RedisError, SegmentUnavailable))
            token_wait = fetched.token_wait
            await self._fetched(request, fetched)
        except FetchError as exc:
            token_wait = exc.token_wait
            if exc.status == Status.ROBOTS_UNAVAILABLE and exc.retry_at is not None:
                await self._wait_for_robots(request, exc.retry_at)
            elif is_retryable(exc.status):
                await self._retry_or_fail(request, exc.status, exc.http_status)
            else:
                await self._fail(request, exc.status, exc.http_status,
                                 windows=in_windows(exc.status))
        return time.monotonic() - started - token_wait

    async def _fetched(self, request: CrawlRequest, fetched: Fetched) -> None:
        status = fetched.status
        ttfb = fetched.ttfb
        if status in LINK_ROT_STATUSES:
            await self._send(LINK_ROT_TOPIC, link_rot_message(request.uuid))
            await self._record(request.source, str(status), success=False, ttfb=ttfb)
        elif status == 429 or status >= 500:
            await self._retry_or_fail(request, str(status), status, ttfb)
        elif not 200 <= status < 300:
            await self._fail(request, str(status), status, ttfb=ttfb)
        else:
            try:
                analysis = await self._analyze(fetched.body, self._target)
            finally:
                fetched.body.release()  # not held while the outcome is published (only 2xx have one)
            if analysis.error:
                await self._fail(request, analysis.error, status, ttfb=ttfb)
            else:
                await self._succeed(request, fetched, analysis)

    async def _succeed(self, request: CrawlRequest, fetched: Fetched, analysis: Analysis) -> None:
        directives = applicable_directives(_header_values(fetched.headers, "X-Robots-Tag"),
                                           self._agent_token)
        if not forbids_thumbnail(directives):
            await persist("s3_put", lambda: self._thumbnails.put(request.uuid, analysis.thumbnail))
        if analysis.exif:
            await self._send(METADATA_TOPIC, exif_message(request.uuid, analysis.exif))
        await self._send(METADATA_TOPIC, quality_message(
            request.uuid, analysis.width, analysis.height, analysis.compression_quality,
            fetched.size, x_robots_tag=directives))
        await self._record(request.source, str(fetched.status), success=True, ttfb=fetched.ttfb)

    async def _wait_for_robots(self, request: CrawlRequest, retry_at: float) -> None:
        """Send the URL to wait for its robots.txt, or end it once it has waited too long."""
        now = time.time()
        since = now if request.robots_wait_since is None else request.robots_wait_since
        give_up_at = since + self._robots_give_up
        if now >= give_up_at:
            await self._fail(request, Status.ROBOTS_UNAVAILABLE, None,
                             windows=in_windows(Status.ROBOTS_UNAVAILABLE))
            return
        topic, value = wait_message(replace(request, robots_wait_since=since), min(retry_at, give_up_at), now)
        await self._send(topic, value)

    async def _retry_or_fail(self, request: CrawlRequest, status: str, http_status: int | None,
                             ttfb: float | None = None) -> None:
        if request.attempts < self._max_retries:
            retry = replace(request, attempts=request.attempts + 1)
            await self._send(INBOUND_TOPIC, retry.to_json())
            await self._record(request.source, status, success=False, ttfb=ttfb)
        else:
            await self._fail(request, status, http_status, ttfb=ttfb)

    async def _fail(self, request: CrawlRequest, status: str, http_status: int | None,
                    windows: bool = True, ttfb: float | None = None) -> None:
        reason = f"HTTP {status}" if status.isdigit() else status
        await self._send(CRAWL_ERRORS_TOPIC, crawl_error_message(request, reason, http_status))
        await self._record(request.source, status, success=False, windows=windows, ttfb=ttfb)

    async def _send(self, topic: str, value: bytes) -> None:
        await persist(f"kafka_send:{topic}", lambda: self._producer.send(topic, value))

    async def _record(self, source: str, status: str, success: bool, windows: bool = True,
                      ttfb: float | None = None) -> None:
        await persist("redis_stats", lambda: self._stats.record(source, status, success, windows, ttfb))


def _header_values(headers: Mapping[str, str], name: str) -> list[Any]:
    getall = getattr(headers, "getall", None)
    if getall is not None:
        return list(getall(name, []))
    return [headers[name]] if name in headers else []
