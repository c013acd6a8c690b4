"""One URL from download to its single terminal outcome (SPEC.md §1).

Outcomes: a quality message (plus the EXIF message and the thumbnail) on
success; ``link_rot`` for 404 and 410; a retry through ``inbound_images``
for transient failures while attempts remain; ``crawl_errors`` for every
other end. A URL whose host's robots.txt cannot be had is no outcome yet: it
waits in a wait topic (``worker.parking.wait_topics``) and comes back, up to
``ROBOTS_UNAVAILABLE_GIVE_UP`` after it first found robots.txt unavailable.
``process`` returns only once its outcome (or its wait) is acknowledged, so
the scheduler can commit the message's offset.

Failures of our own infrastructure (Kafka, S3, Redis) are never a URL's
outcome: the task waits them out (``persist``) and is cancelled, uncommitted,
if the worker stops first. A refusal of this one URL's output is not such a
failure, and waiting it out would hold the task (and its partition's commits)
forever: S3 refusing the thumbnail's object, Kafka refusing one message (too
large, invalid), Redis refusing a value. It ends the URL in ``crawl_errors``
(``ThumbnailRefused``, ``MessageRefused``, ``RedisRefused``); only the last is
in the breaker's windows (``common.statuses.NOT_IN_WINDOWS`` says why). So does
an unexpected exception (a bug: ``task_crashed`` in the log), named by its class
and kept out of the windows: left unfinished, the URL would have no outcome and
hold its partition's commit until the worker restarts.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from contextvars import ContextVar
from dataclasses import replace
from typing import Any, TypeVar
from collections.abc import Awaitable, Callable, Mapping

from redis.exceptions import RedisError

from common.contracts import EVENT_DOWNSTREAM_REFUSED, EVENT_INFRA_RETRY, EVENT_OUTCOME_UNWRITABLE, EVENT_TASK_CRASHED
from common.contracts import (CRAWL_ERRORS_TOPIC, INBOUND_TOPIC, LINK_ROT_TOPIC, METADATA_TOPIC,
                              OPTED_OUT_TOPIC, SIGNAL_ROBOTS, CrawlRequest, crawl_error_message, exif_message,
                              link_rot_message, opted_out_message, quality_message)
from common.jsonlog import log_event
from common.kafka import MessageRefused
from common.redis_client import refuses_the_value
from common.settings import Settings
from common.statuses import OPT_OUTS, RULES_UNAVAILABLE, Status, in_windows, is_retryable
from common.protocols import MessageProducer
from worker import metrics
from worker.constants import INFRA_RETRY_FIRST_DELAY, INFRA_RETRY_MAX_DELAY, LINK_ROT_STATUSES
from worker.fetching.fetch import Fetched, FetchError, Fetcher
from worker.imaging.analysis import Analysis
from worker.imaging.thumbnails import ThumbnailRefused, ThumbnailStore
from worker.fetching.shared_memory import Body, SegmentUnavailable
from worker.fetching.tokens import ShuttingDown, SourceHalted
from worker.politeness.consent import Decision
from worker.politeness.retry_after import PAUSE_STATUSES
from worker.politeness.robots import product_token
from common.robots_tag import applicable_directives, forbids_thumbnail
from worker.parking.wait_topics import wait_message
from worker.outcomes.stats import Stats

T = TypeVar("T")
Analyze = Callable[[Body, int], Awaitable[Analysis]]  # the body, the thumbnail's target size


class Refusal(Exception):
    """A downstream refused this one message, object or value: the same call would get the same
    answer, and other calls are unaffected. Raised by ``persist`` instead of retrying."""

    def __init__(self, status: Status, http_status: int | None, what: str, error: str):
        super().__init__(f"{what}: {error}")
        self.status = status
        self.http_status = http_status  # S3's answer; None for Kafka and Redis
        self.what = what
        self.error = error


def refusal(what: str, exc: Exception) -> Refusal | None:
    """The Refusal ``exc`` stands for, or None for an outage (unreachable, 5xx, throttled, ...)."""
    error = repr(exc)[:500]
    if isinstance(exc, ThumbnailRefused):
        return Refusal(Status.THUMBNAIL_REFUSED, exc.status, what, error)
    if isinstance(exc, MessageRefused):
        return Refusal(Status.MESSAGE_REFUSED, None, what, error)
    if refuses_the_value(exc):
        return Refusal(Status.REDIS_REFUSED, None, what, error)
    return None


# The seconds a task has spent waiting out our own infrastructure (``persist``), for ``process``
# to leave out of its work, as it leaves out token waits.
_outage_seconds: ContextVar[list[float] | None] = ContextVar("outage_seconds", default=None)


async def persist(what: str, operation: Callable[[], Awaitable[T]],
                  retry_on: tuple[type[Exception], ...] = (Exception,)) -> T:
    """Run ``operation`` until it succeeds, backing off: for calls to our own infrastructure.
    A refusal of the one call (``refusal``) is raised as a Refusal, never retried.

    From the first failed attempt to the start of the last one counts as an outage, not as
    the task's work: an outage is not the source's latency, which sizes its slots and parks."""
    delay = INFRA_RETRY_FIRST_DELAY
    failed_at: float | None = None
    while True:
        attempt_at = time.monotonic()
        outage = _outage_seconds.get()
        if failed_at is not None and outage is not None:
            outage[0] += attempt_at - failed_at
        try:
            return await operation()
        except retry_on as exc:
            failed_at = attempt_at
            refused = refusal(what, exc)
            if refused is not None:
                raise refused from exc
            wait = delay * random.uniform(0.5, 1.0)
            log_event(EVENT_INFRA_RETRY, what=what, error=repr(exc)[:500], retry_in=round(wait, 3))
            metrics.infra_retry(what, exc)
            await asyncio.sleep(wait)
            delay = min(delay * 2, INFRA_RETRY_MAX_DELAY)


async def deliver(producer: MessageProducer, topic: str, value: bytes, key: str | None = None,
                  partition: int | None = None, **context: Any) -> bool:
    """Send ``value``, waiting out outages; False (and a ``downstream_refused`` line naming
    ``context``) if Kafka refuses this message, which no wait would change."""
    try:
        await persist(f"kafka_send:{topic}", lambda: producer.send(topic, value, key, partition))
        return True
    except Refusal as refused:
        log_event(EVENT_DOWNSTREAM_REFUSED, what=refused.what, status=refused.status, error=refused.error,
                  **context)
        return False


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
        outage = [0.0]
        _outage_seconds.set(outage)  # this task's own context
        try:
            token_wait = await self._crawl(request)
        except Refusal as refused:
            token_wait = 0.0
            await self._refused(request, refused)
        except (ShuttingDown, SourceHalted):
            raise  # nothing was sent: the scheduler parks the URL
        except Exception as exc:  # noqa: BLE001 - a bug: the URL still ends, not held unfinished with its partition's commit
            token_wait = 0.0
            log_event(EVENT_TASK_CRASHED, identifier=request.uuid, source=request.source, error=repr(exc)[:500])
            await self._fail(request, type(exc).__name__, None, windows=False)
        return time.monotonic() - started - token_wait - outage[0]

    async def _crawl(self, request: CrawlRequest) -> float:
        """The outcome of ``request``; returns the seconds spent waiting for tokens."""
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
            if exc.status in RULES_UNAVAILABLE and exc.retry_at is not None:
                await self._wait_for_robots(request, exc.retry_at, exc.status)
            elif exc.decision is not None or exc.status in OPT_OUTS:
                decision = exc.decision or Decision(SIGNAL_ROBOTS, exc.status)
                await self._opted_out(request, exc.status, decision, exc.http_status)
            elif is_retryable(exc.status):
                await self._retry_or_fail(request, exc.status, exc.http_status)
            else:
                await self._fail(request, exc.status, exc.http_status,
                                 windows=in_windows(exc.status))
        return token_wait

    async def _refused(self, request: CrawlRequest, refused: Refusal) -> None:
        """End the URL whose output a downstream refused in ``crawl_errors``; if that message is
        refused too, the outcome cannot be written: say so in the log (with the whole URL)."""
        log_event(EVENT_DOWNSTREAM_REFUSED, what=refused.what, status=refused.status,
                  http_status=refused.http_status, identifier=request.uuid, source=request.source,
                  error=refused.error)
        try:
            if refused.what != f"kafka_send:{CRAWL_ERRORS_TOPIC}":
                await self._fail(request, refused.status, refused.http_status,
                                 windows=in_windows(refused.status))
                return
        except Refusal as again:
            refused = again
        log_event(EVENT_OUTCOME_UNWRITABLE, identifier=request.uuid, url=request.url, source=request.source,
                  reason=refused.status, error=refused.error)
        await self._record(request.source, refused.status, success=False, windows=in_windows(refused.status),
                           terminal=True)  # its end, though only the log has it

    async def _fetched(self, request: CrawlRequest, fetched: Fetched) -> None:
        status = fetched.status
        ttfb = fetched.ttfb
        if status in LINK_ROT_STATUSES:
            await self._outcome(LINK_ROT_TOPIC, request, link_rot_message(request.uuid))
            await self._record(request.source, str(status), success=False, ttfb=ttfb, terminal=True)
            metrics.outcome(metrics.LINK_ROT)
        elif status == 429 or status >= 500:
            await self._retry_or_fail(request, str(status), status, ttfb)
        elif not 200 <= status < 300:
            await self._fail(request, str(status), status, ttfb=ttfb)
        else:
            # The site's answer time, counted before the image pool's queue (the back-off's evidence).
            await persist("redis_stats", lambda: self._stats.answered(request.source, ttfb))
            try:
                analysis = await self._analyze(fetched.body, self._target)
            finally:
                fetched.body.release()  # not held while the outcome is published (only 2xx have one)
            if analysis.error:
                await self._fail(request, analysis.error, status)
            else:
                await self._succeed(request, fetched, analysis)

    async def _succeed(self, request: CrawlRequest, fetched: Fetched, analysis: Analysis) -> None:
        directives = applicable_directives(_header_values(fetched.headers, "X-Robots-Tag"),
                                           self._agent_token)
        if not forbids_thumbnail(directives):
            await persist("s3_put", lambda: self._thumbnails.put(request.uuid, analysis.thumbnail))
        if analysis.exif:
            await self._outcome(METADATA_TOPIC, request, exif_message(request.uuid, analysis.exif))
        await self._outcome(METADATA_TOPIC, request, quality_message(
            request.uuid, analysis.width, analysis.height, analysis.compression_quality,
            fetched.size, x_robots_tag=directives))
        await self._record(request.source, str(fetched.status), success=True, terminal=True)  # its time counted
        metrics.outcome(metrics.SUCCESS)

    async def _opted_out(self, request: CrawlRequest, status: str, decision: Decision,
                         http_status: int | None) -> None:
        """End the URL its site opted out of: no body was read, nothing of the image is kept."""
        await self._outcome(OPTED_OUT_TOPIC, request,
                            opted_out_message(request, decision.signal, decision.value, http_status))
        await self._record(request.source, status, success=False, windows=in_windows(status), terminal=True,
                           opted_out=decision.signal)
        metrics.opted_out(decision.signal)

    async def _wait_for_robots(self, request: CrawlRequest, retry_at: float,
                               status: str = Status.ROBOTS_UNAVAILABLE) -> None:
        """Send the URL to wait for its rules file (robots.txt, tdmrep.json), or end it once it has
        waited too long (``robots_wait_since`` is when one of them first was unavailable)."""
        now = time.time()
        since = now if request.robots_wait_since is None else request.robots_wait_since
        give_up_at = since + self._robots_give_up
        if now >= give_up_at:
            await self._fail(request, status, None, windows=in_windows(status))
            return
        topic, value = wait_message(replace(request, robots_wait_since=since), min(retry_at, give_up_at), now)
        await self._send(topic, value)
        metrics.outcome(metrics.ROBOTS_WAIT)

    async def _retry_or_fail(self, request: CrawlRequest, status: str, http_status: int | None,
                             ttfb: float | None = None) -> None:
        if request.attempts < self._max_retries:
            retry = replace(request, attempts=request.attempts + 1)
            if http_status in PAUSE_STATUSES and retry.retry_after_since is None:
                retry = replace(retry, retry_after_since=time.time())
            await self._send(INBOUND_TOPIC, retry.to_json())
            await self._record(request.source, status, success=False, ttfb=ttfb, terminal=False)
            metrics.outcome(metrics.RETRY)
        else:
            await self._fail(request, status, http_status, ttfb=ttfb)

    async def _fail(self, request: CrawlRequest, status: str, http_status: int | None,
                    windows: bool = True, ttfb: float | None = None) -> None:
        reason = f"HTTP {status}" if status.isdigit() else status
        await self._outcome(CRAWL_ERRORS_TOPIC, request, crawl_error_message(request, reason, http_status))
        await self._record(request.source, status, success=False, windows=windows, ttfb=ttfb, terminal=True,
                           retried=request.attempts > 0)
        metrics.outcome(metrics.CRAWL_ERROR)

    async def _send(self, topic: str, value: bytes, key: str | None = None) -> None:
        await persist(f"kafka_send:{topic}", lambda: self._producer.send(topic, value, key))

    async def _outcome(self, topic: str, request: CrawlRequest, value: bytes) -> None:
        """Keyed by uuid: a URL's EXIF and quality messages share a partition, in the order sent,
        so a reader joining them (``url_lists.export``) meets the EXIF first. A URL that waited
        says since when in its outcome (SPEC.md §1)."""
        waits = request.waits()
        if waits:
            value = json.dumps({**json.loads(value), **waits}).encode()
        await self._send(topic, value, request.uuid)

    async def _record(self, source: str, status: str, success: bool, windows: bool = True,
                      ttfb: float | None = None, *, terminal: bool, retried: bool = False,
                      opted_out: str | None = None) -> None:
        """``terminal``: the URL's one outcome (it leaves its source's backlog); False for a retry.
        ``retried``: a failure after a failed attempt (the breaker counts one error a URL).
        ``opted_out``: the signal that ended it (counted per signal, not as an error)."""
        await persist("redis_stats", lambda: self._stats.record(source, status, success, windows, ttfb,
                                                                terminal=terminal, retried=retried,
                                                                opted_out=opted_out))


def _header_values(headers: Mapping[str, str], name: str) -> list[Any]:
    getall = getattr(headers, "getall", None)
    if getall is not None:
        return list(getall(name, []))
    return [headers[name]] if name in headers else []
