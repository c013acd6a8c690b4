"""The error circuit breaker (SPEC.md §3): stop crawling a source that its errors say we are hurting.

Workers record every request's status; this reads those records once a second, for the
sources with an outcome in the last minute (``active_sources``) and the paused ones.
A surge (errors above 10% of the last minute's answers, and more than a site failing 3% of
the time shows by chance: a binomial tail) pauses the source until the minute no longer shows
it; 50 failures in a row halt it until an operator looks (``srem halted {source}``). Only
unexpected statuses count as errors: a 404 is the site working as it should. A URL counts one error at most in the
minute window (a retried URL's failure after a failed attempt is not in it), the last-50 list
holds every attempt.
"""
from __future__ import annotations

import json
import math
from collections import Counter

from common import contracts
from common.redis_values import as_text
from common.statuses import is_expected
from common.jsonlog import log_event
from common.source_sets import stopped_among
from common.protocols import AsyncRedis
from crawl_monitor.active_sources import active_scores, active_since, forget_quiet
from crawl_monitor.batched_keys import KEYS_BATCH, BatchedKeys
from crawl_monitor.constants import (ACTIVE_SOURCES_SLACK_SECONDS, BREAKER_FULL_PASS_SECONDS, BUCKET_TRIM_SECONDS,
                                     TEMP_HALT_ERROR_RATIO, TEMP_HALT_FALSE_ALARM, TEMP_HALT_HEALTHY_ERROR_RATIO,
                                     TEMP_HALT_MIN_SAMPLES, TEMP_HALT_WINDOW_SECONDS)


# KEYS: per source its minute window, then its last-50 list; ARGV: the bound below which the
# window's members are dropped, the start of the part read, the last-50 length. The reply: per
# source the window's members since that start, then the list's newest statuses (workers RPUSH).
# One call a batch instead of three redis-py commands a source (``crawl_monitor.batched_keys``).
READ_WINDOWS = """
local out = {}
for i = 1, #KEYS, 2 do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', ARGV[1])
  out[#out + 1] = redis.call('ZRANGEBYSCORE', KEYS[i], ARGV[2], '+inf')
  out[#out + 1] = redis.call('LRANGE', KEYS[i + 1], -tonumber(ARGV[3]), -1)
end
return out
"""


def status_of(member: str) -> str:
    """A window member is ``{status}:{unique suffix}``."""
    return member.partition(":")[0]


def healthy_tail(errors: int, total: int, share: float = TEMP_HALT_HEALTHY_ERROR_RATIO) -> float:
    """The chance that ``total`` answers failing ``share`` of the time at random hold ``errors`` or more."""
    if errors <= 0:
        return 1.0
    if errors > total:
        return 0.0
    term = math.exp(math.lgamma(total + 1) - math.lgamma(errors + 1) - math.lgamma(total - errors + 1)
                    + errors * math.log(share) + (total - errors) * math.log1p(-share))
    tail, odds = term, share / (1 - share)
    for count in range(errors, total):
        term *= (total - count) / (count + 1) * odds
        tail += term
        if term <= tail * 1e-12:
            break
    return min(tail, 1.0)


def error_surge(errors: int, total: int) -> bool:
    """More than 10% errors, and more than a healthy site shows by chance (docs/decisions.md,
    "The breaker halts for errors, not chance")."""
    return (total >= TEMP_HALT_MIN_SAMPLES and errors > TEMP_HALT_ERROR_RATIO * total
            and healthy_tail(errors, total) < TEMP_HALT_FALSE_ALARM)


def surge_of_errors(statuses: list[str]) -> bool:
    """``error_surge`` on the minute's statuses: only unexpected ones are errors."""
    return error_surge(sum(1 for status in statuses if not is_expected(status)), len(statuses))


def every_request_failed(last_statuses: list[str]) -> bool:
    """A full window of the last 50 requests, none of which went as expected."""
    return (len(last_statuses) == contracts.LAST_50_LENGTH
            and not any(is_expected(status) for status in last_statuses))


def _codes(statuses: list[str]) -> str:
    return json.dumps(dict(Counter(statuses).most_common()))


class CircuitBreaker:
    """Adds sources to ``temp_halted`` / ``halted``; the regulator then gives them no tokens."""

    def __init__(self, redis: AsyncRedis):
        self._redis = redis
        self._read_windows = redis.register_script(READ_WINDOWS)
        self._keys = BatchedKeys(redis)
        self._next_bucket_trim = 0.0
        self._last_check = float("-inf")  # none yet: the first check is a full pass
        self._next_full_pass = float("-inf")  # every source with an outcome in the last minute
        self._last_bucket_trim = float("-inf")  # none yet
        self._seen: dict[str, float] = {}  # source -> its latest outcome when last judged
        # Sources whose minute held an unexpected status when last judged: only their windows
        # can surge as they age (a window without errors only loses members).
        self._errored: set[str] = set()

    async def check(self, now: float) -> None:
        """Judge every source on its requests up to ``now`` (Unix time, as workers score them)."""
        # A source without an outcome in the last minute has nothing new to judge: its window
        # only empties, which matters to a temporary halt alone. A
        # full pass (the first check, then every BREAKER_FULL_PASS_SECONDS) judges every source
        # with an outcome in the last minute: no monitor means no tokens, so nothing older is
        # new. Between two full passes, only the sources with outcomes since the last check: a
        # window that merely ages (successes leaving it before errors) is judged within a pass.
        # Nothing here reads every source ever seen.
        # Between full passes a source is judged only if its latest activity changed since the
        # last check, not on ACTIVE_SOURCES_SLACK_SECONDS of slack: that judged each ~6 times.
        full_pass = now >= self._next_full_pass
        if full_pass:
            since, self._next_full_pass = now - contracts.MINUTE_WINDOW_SECONDS, now + BREAKER_FULL_PASS_SECONDS
        else:
            since = self._last_check
        # A full pass after the first re-judges, of the unchanged, only the windows with errors.
        scores = await active_scores(self._redis, since - ACTIVE_SOURCES_SLACK_SECONDS)
        recent = {s for s, at in scores.items() if self._seen.get(s) != at or (full_pass and s in self._errored)}
        if full_pass:
            self._seen = {s: at for s, at in self._seen.items() if s in scores}
            self._errored &= set(scores)
        self._seen.update(scores)
        self._last_check = now
        # A temporary halt lasts at most a minute past its source's last outcome: few, all judged.
        temp_halted = {as_text(s) for s in await self._redis.smembers(contracts.TEMP_HALTED)}
        sources = sorted(recent | temp_halted)
        if sources:
            await self._judge_all(sources, temp_halted, now)
        if now >= self._next_bucket_trim:
            # Buckets are added only with outcomes: the sources active since the last trim (the
            # first trim: within its interval, as a stopped monitor means no outcomes).
            last = now - BUCKET_TRIM_SECONDS if self._last_bucket_trim == float("-inf") else self._last_bucket_trim
            self._last_bucket_trim, self._next_bucket_trim = now, now + BUCKET_TRIM_SECONDS
            await self._trim_buckets(sorted(await active_since(self._redis, last - ACTIVE_SOURCES_SLACK_SECONDS)), now)
            await forget_quiet(self._redis, now)

    async def _judge_all(self, sources: list[str], temp_halted: set[str], now: float) -> None:
        halted, _ = await stopped_among(self._redis, sources)
        replies: list = []
        for start in range(0, len(sources), KEYS_BATCH // 2):
            batch = sources[start:start + KEYS_BATCH // 2]
            # Trimming here too keeps the window bounded whatever the workers do.
            replies += await self._read_windows(
                keys=[key for source in batch
                      for key in (contracts.one_minute_window_key(source), contracts.last_50_key(source))],
                args=[f"({now - contracts.MINUTE_WINDOW_SECONDS}", now - TEMP_HALT_WINDOW_SECONDS,
                      contracts.LAST_50_LENGTH])
        for index, source in enumerate(sources):
            minute, last_50 = replies[index * 2:index * 2 + 2]
            statuses = [status_of(m) for m in minute]
            if all(is_expected(status) for status in statuses):
                self._errored.discard(source)
            else:
                self._errored.add(source)
            await self._judge(source, statuses, list(last_50), source in halted, source in temp_halted)

    async def _trim_buckets(self, sources: list[str], now: float) -> None:
        """Drop the count windows' buckets that ended before their window began, in Redis by script
        (docs/decisions.md, "Fleet scale")."""
        await self._keys.drop_buckets_up_to({
            contracts.status_window_key(prefix, source): now - seconds - bucket
            for source in sources for prefix, (seconds, bucket) in contracts.STATUS_COUNT_WINDOWS.items()})

    async def _judge(self, source: str, minute: list[str], last_50: list[str],
                     halted: bool, temp_halted: bool) -> None:
        if not halted and every_request_failed(last_50):
            # SADD's reply says whether we are first: one event per halt.
            if await self._redis.sadd(contracts.HALTED, source):
                log_event(contracts.EVENT_CRAWL_HALTED, type="permanent", source=source,
                          msg=f"{source} tripped permanent halt: the last {len(last_50)} requests failed. "
                              f"Response codes: {_codes(last_50)}. To resume: "
                              f"del {contracts.last_50_key(source)}; srem {contracts.HALTED} {source}")
        surge = surge_of_errors(minute)
        if surge and not temp_halted:
            if await self._redis.sadd(contracts.TEMP_HALTED, source):
                log_event(contracts.EVENT_CRAWL_HALTED, type="temporary", source=source,
                          msg=f"{source} tripped temporary halt. Response codes: {_codes(minute)}")
        elif not surge and temp_halted:
            if await self._redis.srem(contracts.TEMP_HALTED, source):
                log_event(contracts.EVENT_CRAWL_RESUMED, source=source,
                          msg=f"{source}: errors fell back under the threshold; crawling resumes")
