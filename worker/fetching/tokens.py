"""Taking ``currtokens:{source}`` tokens before each request (SPEC.md §2 and 3).

The monitor sets each bucket once a second; a worker ``DECR``s it and may
fetch only if the result is >= 0. The fetcher takes a token only once it
holds the host slot and a connection, right before sending: a token taken
early and spent after a wait for the slot or a handshake would reach the
site in a burst with later ones.
So waiting is split in two: ``until_available`` peeks (no token spent)
until the bucket has something, then ``take`` spends one inside the slot.

A source's tasks wait in turns (``turn``), one task at a time per turn, polling
at an interval that follows the source's rate: hundreds of tasks of a slow source
cost one peek every few hundred milliseconds, not hundreds; and the peeks of
all sources go to Redis together, one MGET at a time. A slow source has one
turn; a fast one a turn per TOKEN_TURN_RATE req/s, since a turn passes a token
only every few rounds of a busy event loop. The script is atomic: turns spare
Redis polls, they guarantee nothing to the site.

Requests are also spaced across the cluster: a bucket refilled once a
second lets one second's tokens go at its end and the next second's at the
start of the next, twice the rate within one second as the site sees it.
So the ``DECR`` runs in a script that first checks two things:

- ``send_pace:{source}``, the source's next send time (GCRA at exactly
  1/rate, the rate from ``rate_limit:{source}``): requests are about 1/rate
  apart whichever worker sends them. A send may go up to
  ``PACE_CATCH_UP_SECONDS`` ahead of its slot, so a worker that was late
  makes up for it rather than leaving the second's tokens unused;
- ``sent_log:{source}``, the send times of the source's last floor(rate) + 1
  requests: the next may go only once the oldest of them is
  ``SEND_WINDOW_SECONDS`` old. This is the promise to the site (no second
  holds more than floor(rate) + 1 of the source's requests), whatever the
  catch-up, the bucket's phase or the number of workers; the window is a
  little over a second so that requests delayed unequally on their way
  (within ``SEND_WINDOW_SECONDS`` - 1 of each other) still arrive within it.

The script reads the time from Redis (``TIME``): one clock for the whole
fleet, so neither a worker whose clock runs behind nor one stalled between
reading its clock and reaching Redis can send early.

The fetcher takes the token last, with its connection open, and writes the
request as soon as the answer is read; so a request's delay from Redis's
decision to the site is at most its answer's round trip. A token whose
request cannot be written within ``STALE_TOKEN_SECONDS`` of the time this
worker's fastest answers take is forfeited rather than spent (it stays in the
send log): the worker (or Redis) was stalled, and a request sent that late
would reach the site bunched with the next ones, sent on time by other
workers. ``take`` returns that deadline and the HTTP client checks it just
before writing (``worker.fetching.http_client.TooLate``): a pause after the
answer (a garbage collection, the kernel's scheduler) delays the request as
much as one before it. The baseline is a low quantile of the answer times, not their
mean, as the bound is on the spread of the delays; a Redis that is always far
away stops nothing. Forfeits are reported in ``worker_tokens_forfeited`` (at most once a
minute): many mean a worker short of CPU, whose sources get less than their rate.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from common.contracts import EVENT_WORKER_REFRESH_FAILED, EVENT_WORKER_TOKENS_FORFEITED
from common.contracts import (WAITING_SOURCES, allowed_per_second, rate_limit_key, send_pace_key, sent_log_key,
                              source_requests_key, tokens_key)
from common.jsonlog import log_event
from common.protocols import AsyncRedis
from common.redis_values import non_negative
from worker.constants import (ACTIVE_HEARTBEAT_SECONDS, ARRIVAL_JITTER_SECONDS, FORFEIT_REPORT_SECONDS,
                              PACE_CATCH_UP_SECONDS, SEND_LOG_MAX, TOKENS_FORGET_CHECK_SECONDS,
                              TOKENS_FORGET_SECONDS,
                              SEND_WINDOW_SECONDS, STALE_TOKEN_SECONDS, TOKEN_ANSWER_SMOOTHING,
                              TOKEN_PEEK_INTERVAL, TOKEN_POLL_MAX, TOKEN_POLL_MIN, TOKEN_TURN_RATE)
from worker.monitor_view import MonitorView


class ShuttingDown(Exception):
    """Raised to a task still waiting for a token when the worker stops: it has sent nothing."""


class SourceHalted(Exception):
    """Raised to a task waiting for a token of a halted source: it has sent nothing, and its
    slot is better used elsewhere until the source resumes."""


# One round trip per request: the pace and log checks, the DECR and, when a token was had,
# the INCR of num_requests:{source}. KEYS: send_pace, currtokens, num_requests, sent_log,
# rate_limit of the source; ARGV: interval (s, 0 when the rate is unknown), tolerance (s), log
# length (0: no log), window (s). Returns {paced, tokens left after DECR, seconds until the next
# send may go, the rate the monitor grants now ('' if none)}: the next request is paced by it.
PACED_DECR = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local interval, tolerance = tonumber(ARGV[1]), tonumber(ARGV[2])
local length, window = tonumber(ARGV[3]), tonumber(ARGV[4])
local function ready(due)
  local at = due - tolerance
  if length > 0 then
    local oldest = tonumber(redis.call('LINDEX', KEYS[4], length - 1) or '')
    if oldest then at = math.max(at, oldest + window) end
  end
  return at
end
local due = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local at = ready(due)
if at > now then
  return {1, 0, tostring(at - now), redis.call('GET', KEYS[5]) or ''}
end
local left = -1
if redis.call('EXISTS', KEYS[2]) == 1 then  -- a DECR of no bucket would leave a key that never expires
  left = redis.call('DECR', KEYS[2])
end
if left >= 0 then
  redis.call('INCR', KEYS[3])
  due = math.max(due, now) + interval
  redis.call('SET', KEYS[1], string.format('%.6f', due), 'PX', math.ceil((due - now) * 1000) + 1000)
  if length > 0 then
    redis.call('LPUSH', KEYS[4], string.format('%.6f', now))
    redis.call('LTRIM', KEYS[4], 0, length - 1)
    redis.call('PEXPIRE', KEYS[4], math.ceil(window * 1000) + 1000)
  end
  at = ready(due)
end
return {0, left, tostring(math.max(0, at - now)), redis.call('GET', KEYS[5]) or ''}
"""


def send_log_length(rate: float) -> int:
    """How many of a source's sends the log keeps: floor(rate) + 1, the most one second may
    hold; bounded for huge rates (an operator's override), whose log then spans a shorter
    window in proportion (``window_for``)."""
    return min(allowed_per_second(rate), SEND_LOG_MAX)


def window_for(rate: float) -> float:
    return SEND_WINDOW_SECONDS * send_log_length(rate) / allowed_per_second(rate)


def tolerated_lateness(rate: float | None) -> float:
    """How much later than the fastest answers a token may still be used at ``rate``.

    floor(rate) + 2 consecutive sends span at least the log's window, and at least
    (floor(rate) + 1) / rate less the catch-up (the pacing); whatever that span exceeds one
    second by, less ``ARRIVAL_JITTER_SECONDS`` for the way to the site, is how unequally two
    requests may be delayed and still not share a second. Above ~5 req/s that is the
    window's 50 ms, so ``STALE_TOKEN_SECONDS`` (30 ms); a source at 0.5 req/s, whose
    requests are 2 s apart, loses a token (and 2 s) only to a stall of most of a second."""
    if not rate:
        return STALE_TOKEN_SECONDS
    paced = allowed_per_second(rate) / rate - PACE_CATCH_UP_SECONDS
    return max(STALE_TOKEN_SECONDS, max(window_for(rate), paced) - 1.0 - ARRIVAL_JITTER_SECONDS)


@dataclass(eq=False, slots=True)
class _Source:
    """What a worker keeps of a source it asked tokens for: one slotted record a source, as a worker
    meets ~170 sources a second at 100,000 one-URL sites (docs/decisions.md, "Fleet scale")."""
    turns: tuple[asyncio.Lock, ...] = ()  # its turns
    next_turn: int = -1        # the turn handed out last
    next_send: float = 0.0     # monotonic time its next token may be spent (>= when one was last asked for)
    last_rate: float | None = None  # the last positive rate it was paced by
    stocked: bool = False      # its last DECR left tokens: no need to peek

    def idle_since(self, before: float) -> bool:
        """No task holds or waits for a turn of it, and no token was asked for or due since ``before``."""
        return self.next_send < before and not any(turn.locked() for turn in self.turns)


def forgettable(sources: Mapping[str, _Source], now: float) -> list[str]:
    """The sources no task has asked tokens for in TOKENS_FORGET_SECONDS."""
    before = now - TOKENS_FORGET_SECONDS
    return [name for name, kept in sources.items() if kept.idle_since(before)]


class TokenBuckets:
    def __init__(self, redis: AsyncRedis, view: MonitorView | None = None, clock: Callable[[], float] = time.time):
        """``view``: the monitor's decisions, for the rates polls are paced by and the halts that
        end a wait (none known: the bucket alone decides). ``clock``: Unix time as the monitor
        reads ``waiting_sources`` (``RedisClock.now``)."""
        self._redis = redis
        self._clock = clock
        self._paced_decr = redis.register_script(PACED_DECR)
        self._view = view or MonitorView()
        self._sources: dict[str, _Source] = {}  # source -> what is kept of it until it is idle
        self._closed = False
        self._sleepers: set[asyncio.Future] = set()
        self._fastest_answer: float | None = None  # a low quantile of the script's answer time, s
        self._peeks: dict[str, asyncio.Future] = {}  # source -> its bucket's value, at the next MGET
        self._peeking: asyncio.Future | None = None  # the task running MGETs while any peek waits
        self._next_peek_read = 0.0  # monotonic time the next MGET may go
        self._forfeited: dict[str, int] = {}  # source -> tokens forfeited since the last report
        self._latest = 0.0  # seconds past its deadline, the latest request forfeited since the last report
        self._forfeits_reported_at = float("-inf")
        self._marked: dict[str, float] = {}  # source -> when it was last scored as waiting (wall clock)
        self._next_forget = 0.0
        self._next_mark_prune = 0.0

    def remembered_sources(self) -> set[str]:
        """The sources anything is kept for (turns, pace, rate, last use); idle ones are forgotten."""
        return set(self._sources)

    def _kept(self, source: str) -> _Source:
        kept = self._sources.get(source)
        if kept is None:
            kept = self._sources[source] = _Source()
        return kept

    def turn(self, source: str) -> asyncio.Lock:
        """A turn of ``source``, held while a task waits for its token: one poller per turn, and
        one turn per TOKEN_TURN_RATE req/s of its rate (as known now), taken in rotation."""
        self._forget_idle()
        kept = self._kept(source)
        wanted = max(1, math.ceil((self._pacing_rate(source, kept) or 0.0) / TOKEN_TURN_RATE))
        if len(kept.turns) < wanted:
            kept.turns += tuple(asyncio.Lock() for _ in range(wanted - len(kept.turns)))
        kept.next_turn = (kept.next_turn + 1) % wanted
        return kept.turns[kept.next_turn]

    def _forget_idle(self) -> None:
        """Drop what is kept for sources no task has waited for lately: a worker crawling
        100,000 sites a day must not keep a lock, a pace and a rate for each. Checked every
        TOKENS_FORGET_CHECK_SECONDS, so a source is kept TOKENS_FORGET_SECONDS after its last use
        and little more. A forgotten source starts afresh: its rate is read again at its next
        token, and its pace and send log are in Redis."""
        now = time.monotonic()
        if now < self._next_forget:
            return
        self._next_forget = now + TOKENS_FORGET_CHECK_SECONDS
        for source in forgettable(self._sources, now):
            del self._sources[source]

    async def until_available(self, source: str) -> float:
        """Wait until the bucket of ``source`` holds a token (without taking it); returns the seconds waited."""
        started = time.monotonic()
        kept = self._sources.get(source)
        await self._sleep((kept.next_send if kept else 0.0) - started)
        while True:
            if self._closed:
                raise ShuttingDown(source)
            if source in self._view.stopped:
                raise SourceHalted(source)
            kept = self._sources.get(source)
            if (kept is not None and kept.stocked) or _count(await self._peek(source)) > 0:
                if (kept := self._sources.get(source)) is not None:
                    kept.stocked = False
                return time.monotonic() - started
            await self._sleep(self._poll_interval(source))

    def _peek(self, source: str) -> asyncio.Future:
        """The bucket's value, read together with every other source's waiting this moment.

        Not one GET per waiting source per poll, which grows with the sources waiting
        (docs/decisions.md, "Thousands of sources"): one MGET is in flight at a time, and it reads
        every bucket asked for meanwhile, at most one read per TOKEN_PEEK_INTERVAL: round
        trips per second stay bounded whatever the number of sources, and a lone waiter
        is not delayed.
        """
        future = self._peeks.get(source)
        if future is None or future.done():  # done: its waiter was cancelled
            future = self._peeks[source] = asyncio.get_running_loop().create_future()
            if self._peeking is None:
                self._peeking = asyncio.ensure_future(self._peek_all())
        return future

    async def _peek_all(self) -> None:
        try:
            while self._peeks:
                # The peeks asked for meanwhile join this read; reads are TOKEN_PEEK_INTERVAL apart.
                await asyncio.sleep(max(0.0, self._next_peek_read - time.monotonic()))
                self._next_peek_read = time.monotonic() + TOKEN_PEEK_INTERVAL
                batch, self._peeks = self._peeks, {}
                try:
                    values = await self._redis.mget([tokens_key(source) for source in batch])
                except Exception as exc:  # noqa: BLE001 - Redis away: each waiter's own retry handles it
                    for future in batch.values():
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for future, value in zip(batch.values(), values, strict=True):
                    if not future.done():
                        future.set_result(value)
                # After the answers, not before: the heartbeats of thousands of slow sources were
                # one more round trip in front of a fast source's every peek.
                try:
                    await self._mark_waiting(batch)
                except Exception as exc:  # noqa: BLE001 - Redis away: the next peeks mark them again
                    self._marked = {s: at for s, at in self._marked.items() if s not in batch}
                    log_event(EVENT_WORKER_REFRESH_FAILED, error=repr(exc)[:300])
        finally:
            self._peeking = None

    async def _mark_waiting(self, sources: Iterable[str]) -> None:
        """Score the sources whose tasks wait for tokens in ``waiting_sources``, at most every
        ACTIVE_HEARTBEAT_SECONDS each: the monitor grants tokens only to the sources active
        lately, and a new source has no outcome yet, a slow or paused one none for
        a long while."""
        now = self._clock()
        due = {source: now for source in sources if self._marked.get(source, 0.0) <= now - ACTIVE_HEARTBEAT_SECONDS}
        if not due:
            return
        if now >= self._next_mark_prune:  # only the sources waiting lately are remembered
            self._next_mark_prune = now + ACTIVE_HEARTBEAT_SECONDS
            self._marked = {s: at for s, at in self._marked.items() if at > now - ACTIVE_HEARTBEAT_SECONDS}
        self._marked.update(due)
        pipe = self._redis.pipeline(transaction=False)
        pipe.zadd(WAITING_SOURCES, due, gt=True)
        await pipe.execute()

    def _pacing_rate(self, source: str, kept: _Source) -> float | None:
        """The rate to space requests by. While a source is paused or halted the monitor
        publishes 0; when the pause ends the bucket refills before this worker's view of
        the rate does, so pacing keeps the last positive rate instead of switching off."""
        rate = self._view.rate(source)
        if rate:
            kept.last_rate = rate
            return rate
        return kept.last_rate

    async def take(self, source: str) -> float | None:
        """Claim the source's send turn, spend one token and count the request: the monotonic time
        by which the request must be written if it may go now (else ``forfeit`` it), or None."""
        kept = self._kept(source)
        rate = self._pacing_rate(source, kept)
        if rate is None:
            # New to this worker, whose view of the rates is refreshed every few seconds: the
            # monitor publishes the rate with the first tokens, so read it rather than send
            # unpaced (a source is granted tokens once a worker waits for them).
            rate = non_negative(await self._redis.get(rate_limit_key(source))) or None
            if rate is not None:
                self._kept(source).last_rate = rate
        # Unknown rate: the bucket alone decides (the monitor publishes the rate with the bucket).
        interval, length, window = (1.0 / rate, send_log_length(rate), window_for(rate)) if rate else (0.0, 0, 0.0)
        asked = time.monotonic()
        paced, left, wait, granted = await self._paced_decr(
            keys=[send_pace_key(source), tokens_key(source), source_requests_key(source), sent_log_key(source),
                  rate_limit_key(source)],
            args=[f"{interval:.6f}", f"{PACE_CATCH_UP_SECONDS:.6f}", str(length), f"{window:.6f}"])
        answered = time.monotonic()
        # The grant as the monitor wrote it this second: the next request is paced by it, not by
        # the view's read of up to REFRESH_INTERVAL ago (a doubled grant was sent at the old pace).
        self._view.saw_rate(source, non_negative(granted))
        kept = self._kept(source)  # anew: forgotten meanwhile if idle and no turn held
        kept.next_send = answered + float(wait)
        if left > 0:
            kept.stocked = True
        if paced or left < 0:
            return None
        send_by = asked + self._allowed_delay(answered - asked, tolerated_lateness(rate))
        if answered > send_by:
            await self.forfeit(source, answered - send_by)
            return None
        return send_by

    async def forfeit(self, source: str, late_by: float) -> None:
        """A token whose request could not be written by its deadline (``late_by`` seconds past it):
        counted in num_requests by the script, uncounted here; it stays in the send log."""
        await self._redis.decr(source_requests_key(source))
        self._report_forfeit(source, late_by)

    def _allowed_delay(self, answer: float, tolerated: float) -> float:
        """Seconds after asking by which a token's request must be written: ``tolerated`` more
        than the fastest answers take (tracked here with this ``answer``)."""
        fastest = answer if self._fastest_answer is None else self._fastest_answer
        # Down at once, up slowly: where answers settle when Redis really is further away now.
        self._fastest_answer = fastest + (answer - fastest) * (1.0 if answer < fastest else TOKEN_ANSWER_SMOOTHING)
        return fastest + tolerated

    def _report_forfeit(self, source: str, late_by: float) -> None:
        self._forfeited[source] = self._forfeited.get(source, 0) + 1
        self._latest = max(self._latest, late_by)
        now = time.monotonic()
        if now - self._forfeits_reported_at >= FORFEIT_REPORT_SECONDS:
            log_event(EVENT_WORKER_TOKENS_FORFEITED, by_source=self._forfeited,
                      late_ms=round(self._latest * 1000, 1),
                      fastest_answer_ms=round((self._fastest_answer or 0.0) * 1000, 1),
                      msg="tokens whose requests could not be written on time: this worker or its Redis stalled")
            self._forfeited, self._latest, self._forfeits_reported_at = {}, 0.0, now

    async def _sleep(self, seconds: float) -> None:
        """Sleep, but wake at once when the worker stops (cheaper than wait_for on an event)."""
        if seconds <= 0 or self._closed:
            return
        wake = asyncio.get_running_loop().create_future()
        timer = asyncio.get_running_loop().call_later(seconds, _settle, wake)
        self._sleepers.add(wake)
        try:
            await wake
        finally:
            timer.cancel()
            self._sleepers.discard(wake)

    def _poll_interval(self, source: str) -> float:
        rate = self._view.rate(source) or 0.0
        interval = TOKEN_POLL_MAX if rate <= 0 else min(TOKEN_POLL_MAX, max(TOKEN_POLL_MIN, 0.2 / rate))
        return interval * random.uniform(0.8, 1.2)  # workers sharing a source spread their polls

    def close(self) -> None:
        """Stop handing out tokens: waiting tasks get ShuttingDown at once."""
        self._closed = True
        for wake in list(self._sleepers):
            _settle(wake)


def _count(raw) -> float:
    try:
        return float(raw)
    except (TypeError, ValueError):  # missing or garbled: no tokens (fail closed)
        return 0.0


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
