"""Per-outcome statistics in Redis (SPEC.md §2), read by the monitor's breakers and dashboards.

Each outcome is one pipeline (one round trip). The breaker's one-minute window
(``status60s``) is a sorted set scored by wall-clock Unix seconds, because every
worker host writes it; members carry a random suffix so two identical statuses in
one instant both count. The hour and twelve-hour windows are counts per time
bucket (``HINCRBY``): a month at 200 requests a second must not keep a member per
request (``status12hr`` alone would hold 8.6 million).

Response times (``response_ms:{source}:{bucket}``, ``common.response_times``) are counts
in latency bins per two-second bucket, for the monitor's adaptive back-off: a key per
bucket, its expiry set by the first outcome of the bucket this worker records.

Every outcome also scores its source in ``active_sources`` with its time: the monitor
re-reads only the sources recent there, so its work follows the sources being crawled.
A terminal outcome (not a retry) also counts in ``urls_ended:{source}``, in the same
pipeline: the splitter counts ``urls_split:{source}``, and the difference is the source's
backlog (issue 26).

Trimming is per source and time, not per outcome: at most every
STATS_TRIM_INTERVAL seconds a source's minute window is trimmed and the expiry of
its windows and last-50 list renewed, in the same pipeline as its outcome: a source
that goes quiet leaves only its counters behind (SPEC.md §2). The breaker trims
too (the count windows' old buckets, once a minute), so nothing it reads changes.
"""
from __future__ import annotations

import math
import os
import time

from redis.exceptions import ResponseError

from common.contracts import EVENT_STATS_REJECTED
from common.contracts import (LAST_50_LENGTH, MINUTE_WINDOW_SECONDS, NUM_RESIZED, RESIZE_ERRORS,
                              SOURCE_STATE_TTL_SECONDS,
                              STATUS_COUNT_WINDOWS, error_statuses_key, errors_key, last_50_key, one_minute_window_key,
                              resized_key, status_count_field, status_window_key)
from common.contracts import ACTIVE_SOURCES, response_times_key, urls_ended_key
from common.jsonlog import log_event
from common.protocols import AsyncRedis
from common.response_times import OVERLOAD_FIELD, RESPONSE_BUCKET_TTL_SECONDS, bin_of, bucket_start
from common.statuses import is_overload
from worker.constants import STATS_FORGET_SECONDS, STATS_TRIM_INTERVAL


class Stats:
    def __init__(self, redis: AsyncRedis):
        self._redis = redis
        self._next_trim: dict[str, float] = {}  # source -> wall-clock time its windows are trimmed next
        self._expiring: dict[str, int] = {}     # source -> the response bucket whose expiry is set
        self._next_forget = 0.0

    def _forget_quiet(self, now: float) -> None:
        """Drop what these dicts hold for sources without an outcome lately: a day's crawl of
        millions of sites must not keep an entry per site. A forgotten source's next outcome
        trims and sets its expiries again, which is what it would do anyway."""
        if now < self._next_forget:
            return
        self._next_forget = now + STATS_FORGET_SECONDS
        self._next_trim = {s: at for s, at in self._next_trim.items() if at > now - STATS_FORGET_SECONDS}
        self._expiring = {s: start for s, start in self._expiring.items() if start > now - STATS_FORGET_SECONDS}

    async def record(self, source: str, status: str, success: bool, windows: bool = True,
                     ttfb: float | None = None, *, terminal: bool) -> None:
        """Count an outcome; ``windows=False`` keeps it out of the breakers' windows (no request was made).
        ``ttfb``: the response's time to first byte in seconds; None when no response came.
        ``terminal``: the URL's end (success, link rot, crawl error), not a retry: it leaves the backlog."""
        pipe = self._redis.pipeline(transaction=False)
        now = time.time()
        self._forget_quiet(now)
        pipe.zadd(ACTIVE_SOURCES, {source: now}, gt=True)  # the monitor then re-reads this source
        trim = False
        if windows:
            pipe.rpush(last_50_key(source), status)  # second in the pipeline: its reply is read below
            self._response_time(pipe, source, status, ttfb, now)
            member = f"{status}:{os.urandom(6).hex()}"
            trim = now >= self._next_trim.get(source, 0.0)
            if trim:
                self._next_trim[source] = now + STATS_TRIM_INTERVAL
            minute = one_minute_window_key(source)
            pipe.zadd(minute, {member: now})
            if trim:
                pipe.zremrangebyscore(minute, "-inf", now - MINUTE_WINDOW_SECONDS)
                # Renewed at trims only: each member outlives its minute until the next one.
                pipe.expire(minute, MINUTE_WINDOW_SECONDS + math.ceil(STATS_TRIM_INTERVAL))
            for prefix, (seconds, bucket) in STATUS_COUNT_WINDOWS.items():
                key = status_window_key(prefix, source)
                pipe.hincrby(key, status_count_field(int(now // bucket * bucket), status), 1)
                if trim:
                    pipe.expire(key, seconds)  # a source that goes quiet leaves nothing behind
            pipe.ltrim(last_50_key(source), -LAST_50_LENGTH, -1)
            if trim:
                pipe.expire(last_50_key(source), SOURCE_STATE_TTL_SECONDS)
        if terminal:
            pipe.incr(urls_ended_key(source))
        if success:
            pipe.incr(NUM_RESIZED)
            pipe.incr(resized_key(source))
        else:
            pipe.incr(RESIZE_ERRORS)
            pipe.incr(errors_key(source))
            pipe.incr(errors_key(source, status))
            pipe.sadd(error_statuses_key(source), status)
        try:
            replies = await pipe.execute()
            if windows and not trim and replies[1] == 1:
                # A list made afresh between two trims (``ctl resume`` deleted it): it expires too.
                renew = self._redis.pipeline(transaction=False)
                renew.expire(last_50_key(source), SOURCE_STATE_TTL_SECONDS)
                await renew.execute()
        except ResponseError as exc:  # e.g. an operator left a key of the wrong type: not worth a stall
            log_event(EVENT_STATS_REJECTED, source=source, status=status, error=str(exc)[:300])

    def _response_time(self, pipe, source: str, status: str, ttfb: float | None, now: float) -> None:
        fields = ([bin_of(ttfb)] if ttfb is not None else []) + ([OVERLOAD_FIELD] if is_overload(status) else [])
        if not fields:
            return
        bucket = bucket_start(now)
        key = response_times_key(source, bucket)
        for field in fields:
            pipe.hincrby(key, str(field), 1)
        if self._expiring.get(source) != bucket:
            self._expiring[source] = bucket
            pipe.expire(key, RESPONSE_BUCKET_TTL_SECONDS)
