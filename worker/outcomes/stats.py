"""Per-outcome statistics in Redis (SPEC.md §2), read by the monitor's breakers and dashboards.

Each outcome is one script call (one round trip). The breaker's one-minute window
(``status60s``) is a sorted set scored by wall-clock Unix seconds, because every
worker host writes it; members carry a random suffix so two identical statuses in
one instant both count. A URL counts one error there at most: a retried URL's failure
after a failed attempt is left out (its success is not). The hour and twelve-hour windows
are counts per time bucket (``HINCRBY``): a month
at 200 requests a second must not keep a member per request (``status12hr`` alone would hold 8.6 million).

Response times (``response_ms:{source}:{bucket}``, ``common.response_times``) are counts
in latency bins per two-second bucket, for the monitor's adaptive back-off: a key per
bucket, its expiry set by the first outcome of the bucket this worker records. A body
the image pool analyses has its time counted as it comes (``answered``), not with the
outcome: the back-off judges the site, and the pool's queue is not the site's.

Every outcome, and every answer counted as it comes, also scores its source in ``active_sources``
with its time: the monitor re-reads only the sources recent there, so its work follows the
sources being crawled.

A terminal outcome (not a retry) also counts in ``urls_ended:{source}``, in the same
call: the splitter counts ``urls_split:{source}``, and the difference is the source's
backlog.

Trimming is per source and time, not per outcome: at most every
STATS_TRIM_INTERVAL seconds a source's minute window is trimmed and the expiry of
its windows and last-50 list renewed, in the same call as its outcome: a source
that goes quiet leaves only its counters behind (SPEC.md §2). The breaker trims
too (the count windows' old buckets, once a minute), so nothing it reads changes.

The commands of one outcome travel as one script call (``RECORD``), not a pipeline of
ten, and so do a response time's two (``ANSWERED``): redis-py packs and parses each command
of a pipeline in Python (docs/decisions.md, "Per-image CPU and the servers' share"). Each
command still runs on its own (``pcall``): one that fails (a key of the wrong type, left
by an operator) is reported and the others count, as in a pipeline.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

from redis.exceptions import ResponseError

from common.contracts import EVENT_STATS_REJECTED
from common.contracts import (LAST_50_LENGTH, MINUTE_WINDOW_SECONDS, NUM_RESIZED, RESIZE_ERRORS,
                              SOURCE_STATE_TTL_SECONDS, STATUS_COUNT_WINDOWS, error_statuses_key, errors_key,
                              last_50_key, one_minute_window_key, resized_key, status_count_field, status_window_key)
from common.contracts import ACTIVE_SOURCES, OPTED_OUT, opted_out_key, response_times_key, urls_ended_key
from common.jsonlog import log_event
from common.protocols import AsyncRedis
from common.response_times import OVERLOAD_FIELD, RESPONSE_BUCKET_TTL_SECONDS, bin_of, bucket_start
from common.statuses import is_expected, is_overload
from worker.constants import STATS_FORGET_CHECK_SECONDS, STATS_FORGET_SECONDS, STATS_TRIM_INTERVAL


# KEYS: active_sources, the minute window, the last 50, the response bucket, urls_ended, the
# count windows (ARGV[10] of them), then the counters: num_resized and resized:{source} for a
# success; opted_out and opted_out:{source} for an opt-out (their field the signal, the ARGV after
# the windows'); resize_errors, errors:{source}, errors:{source}:{status} and error_statuses:{source} else.
# ARGV: 1 now, 2 source, 3 windows (1/0), 4 status, 5 the minute window's member ('': not in it), 6 trim the
# minute window up to this score ('' : not now), 7 the last-50 length, 8 the response bins
# (space-separated, may be none), 9 the response bucket's expiry (0: already set), 10 count
# windows, 11 success (1/0; 2: opted out), 12 terminal (1/0), 13 the minute window's expiry (at a trim),
# 14 the last 50's (at a trim, or when it is new), then per count window its field and expiry
# (0: not now).
# Returns the errors of the commands that failed.
RECORD = """
local errors = {}
local function call(...)
  local reply = redis.pcall(...)
  if type(reply) == 'table' and reply.err then errors[#errors + 1] = reply.err end
end
local now, windows = ARGV[1], tonumber(ARGV[10])
call('ZADD', KEYS[1], 'GT', now, ARGV[2])
if ARGV[3] == '1' then
  local fields = 0
  for field in string.gmatch(ARGV[8], '%S+') do
    call('HINCRBY', KEYS[4], field, 1)
    fields = fields + 1
  end
  if fields > 0 and ARGV[9] ~= '0' then call('EXPIRE', KEYS[4], ARGV[9]) end
  if ARGV[5] ~= '' then call('ZADD', KEYS[2], now, ARGV[5]) end
  if ARGV[6] ~= '' then
    call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[6])
    call('EXPIRE', KEYS[2], ARGV[13])
  end
  for i = 1, windows do
    call('HINCRBY', KEYS[5 + i], ARGV[13 + 2 * i], 1)
    if ARGV[14 + 2 * i] ~= '0' then call('EXPIRE', KEYS[5 + i], ARGV[14 + 2 * i]) end
  end
  local length = redis.pcall('RPUSH', KEYS[3], ARGV[4])
  if type(length) == 'table' and length.err then
    errors[#errors + 1] = length.err
  elseif ARGV[6] ~= '' or length == 1 then  -- a list made afresh (ctl resume deleted it) expires too
    call('EXPIRE', KEYS[3], ARGV[14])
  end
  call('LTRIM', KEYS[3], -tonumber(ARGV[7]), -1)
end
if ARGV[12] == '1' then call('INCR', KEYS[5]) end
local counters = 6 + windows
if ARGV[11] == '2' then
  call('HINCRBY', KEYS[counters], ARGV[15 + 2 * windows], 1)
  call('HINCRBY', KEYS[counters + 1], ARGV[15 + 2 * windows], 1)
elseif ARGV[11] == '1' then
  call('INCR', KEYS[counters])
  call('INCR', KEYS[counters + 1])
else
  call('INCR', KEYS[counters])
  call('INCR', KEYS[counters + 1])
  call('INCR', KEYS[counters + 2])
  call('SADD', KEYS[counters + 3], ARGV[4])
end
return errors
"""


# A response's time counted as it comes, and its source scored active: the monitor reads the
# answers of the sources active lately, and a first outcome waits for the image pool (seconds behind
# the answers on a busy machine, so a slow start went unjudged that long). KEYS: the response
# bucket, active_sources; ARGV: 1 its bin, 2 its expiry (0: already set), 3 now, 4 the source. Every
# command runs (``pcall``) and the first error is the reply, as a pipeline of them raises its first.
ANSWERED = """
local counted = redis.pcall('HINCRBY', KEYS[1], ARGV[1], 1)
local expiring = 0
if ARGV[2] ~= '0' then expiring = redis.pcall('EXPIRE', KEYS[1], ARGV[2]) end
local scored = redis.pcall('ZADD', KEYS[2], 'GT', ARGV[3], ARGV[4])
for _, reply in ipairs({counted, expiring, scored}) do
  if type(reply) == 'table' and reply.err then return reply end
end
return 0
"""


class Stats:
    def __init__(self, redis: AsyncRedis, clock: Callable[[], float] = time.time):
        """``clock``: Unix time as the monitor reads the scores and buckets written here (``RedisClock.now``)."""
        self._redis = redis
        self._clock = clock
        self._record = redis.register_script(RECORD)
        self._answered = redis.register_script(ANSWERED)
        self._next_trim: dict[str, float] = {}  # source -> wall-clock time its windows are trimmed next
        self._expiring: dict[str, int] = {}     # source -> the response bucket whose expiry is set
        self._next_forget = 0.0

    def _forget_quiet(self, now: float) -> None:
        """Drop what these dicts hold for sources without an outcome lately: a day's crawl of
        millions of sites must not keep an entry per site. A forgotten source's next outcome
        trims and sets its expiries again, which is what it would do anyway. Checked every
        STATS_FORGET_CHECK_SECONDS, so a source is kept STATS_FORGET_SECONDS and little more."""
        if now < self._next_forget:
            return
        self._next_forget = now + STATS_FORGET_CHECK_SECONDS
        self._next_trim = {s: at for s, at in self._next_trim.items() if at > now - STATS_FORGET_SECONDS}
        self._expiring = {s: start for s, start in self._expiring.items() if start > now - STATS_FORGET_SECONDS}

    async def answered(self, source: str, ttfb: float) -> None:
        """Count a response's time to first byte in the bucket it came in; its outcome is recorded
        later with ``ttfb=None``."""
        now = self._clock()
        bucket = bucket_start(now)
        expiry = 0
        if self._expiring.get(source) != bucket:
            self._expiring[source] = bucket
            expiry = RESPONSE_BUCKET_TTL_SECONDS
        await self._answered(keys=[response_times_key(source, bucket), ACTIVE_SOURCES],
                             args=[str(bin_of(ttfb)), expiry, repr(now), source])

    async def record(self, source: str, status: str, success: bool, windows: bool = True,
                     ttfb: float | None = None, *, terminal: bool, retried: bool = False,
                     opted_out: str | None = None) -> None:
        """Count an outcome; ``windows=False`` keeps it out of the breakers' windows (no request was made).
        ``ttfb``: the response's time to first byte in seconds; None when no response came.
        ``terminal``: the URL's end (success, link rot, crawl error), not a retry: it leaves the backlog.
        ``retried``: an attempt after a failed one, whose error the minute window already holds.
        ``opted_out``: the signal of an opt-out, counted in ``opted_out[:{source}]``, not as an error."""
        now = self._clock()
        self._forget_quiet(now)
        bucket = bucket_start(now)
        bins = ([str(bin_of(ttfb))] if ttfb is not None else []) + ([OVERLOAD_FIELD] if is_overload(status) else [])
        response_expiry = 0
        trim = windows and now >= self._next_trim.get(source, 0.0)
        if windows:
            if bins and self._expiring.get(source) != bucket:
                self._expiring[source] = bucket
                response_expiry = RESPONSE_BUCKET_TTL_SECONDS
            if trim:
                self._next_trim[source] = now + STATS_TRIM_INTERVAL
        keys = [ACTIVE_SOURCES, one_minute_window_key(source), last_50_key(source),
                response_times_key(source, bucket), urls_ended_key(source)]
        window_args: list[str | int] = []
        for prefix, (seconds, window_bucket) in STATUS_COUNT_WINDOWS.items():
            keys.append(status_window_key(prefix, source))
            window_args += [status_count_field(int(now // window_bucket * window_bucket), status),
                            seconds if trim else 0]  # a source that goes quiet leaves nothing behind
        if success:
            keys += [NUM_RESIZED, resized_key(source)]
        elif opted_out is not None:
            keys += [OPTED_OUT, opted_out_key(source)]
            window_args.append(opted_out)
        else:
            keys += [RESIZE_ERRORS, errors_key(source), errors_key(source, status), error_statuses_key(source)]
        counted_before = retried and not is_expected(status)
        member = "" if counted_before else f"{status}:{os.urandom(6).hex()}"
        args = [repr(now), source, int(windows), status, member,
                repr(now - MINUTE_WINDOW_SECONDS) if trim else "", LAST_50_LENGTH, " ".join(bins),
                response_expiry, len(STATUS_COUNT_WINDOWS), 2 if opted_out is not None else int(success), int(terminal),
                # Renewed at trims only: each member outlives its minute until the next one.
                MINUTE_WINDOW_SECONDS + math.ceil(STATS_TRIM_INTERVAL), SOURCE_STATE_TTL_SECONDS, *window_args]
        try:
            errors = await self._record(keys=keys, args=args)
        except ResponseError as exc:  # the script itself refused: not worth a stall either
            errors = [str(exc)]
        if errors:  # e.g. an operator left a key of the wrong type
            log_event(EVENT_STATS_REJECTED, source=source, status=status, error="; ".join(map(str, errors))[:300])
