"""Taking ``currtokens:{source}`` tokens before each request (SPEC 2 and 3).

The monitor sets each bucket once a second; a worker ``DECR``s it and may
fetch only if the result is >= 0. The fetcher takes a token only once it
holds the host slot, right before sending: a token taken early and spent
after a wait for the slot would reach the site in a burst with later ones.
So waiting is split in two: ``until_available`` peeks (GET, no token spent)
until the bucket has something, then ``take`` spends one inside the slot.

Only one task per source waits at a time (``one_at_a_time``), polling at an
interval that follows the source's rate: hundreds of tasks of a slow source
cost one GET every few hundred milliseconds, not hundreds.

Requests are also spaced across the cluster: a bucket refilled once a
second lets one second's tokens go at its end and the next second's at the
start of the next, twice the rate within one second as the site sees it.
So before its ``DECR`` a worker claims ``send_pace:{source}`` (SET NX with
a 1/rate expiry, the rate from ``rate_limit:{source}``): requests to a
source are at least 1/rate apart whichever worker sends them.
"""
from __future__ import annotations

import asyncio
import random
import time
from typing import Callable

from common.contracts import send_pace_key, tokens_key
from worker.constants import PACE_MARGIN, TOKEN_POLL_MAX, TOKEN_POLL_MIN


class ShuttingDown(Exception):
    """Raised to a task still waiting for a token when the worker stops: it has sent nothing."""


class SourceHalted(Exception):
    """Raised to a task waiting for a token of a halted source: it has sent nothing, and its
    slot is better used elsewhere until the source resumes."""


class TokenBuckets:
    def __init__(self, redis, rate_of: Callable[[str], float | None] = lambda source: None):
        self._redis = redis
        self._rate_of = rate_of
        self._locks: dict[str, asyncio.Lock] = {}
        self._closed = asyncio.Event()
        self._halted: set[str] = set()
        self._next_send: dict[str, float] = {}  # source -> monotonic time its next token may be spent

    def one_at_a_time(self, source: str) -> asyncio.Lock:
        """Held while a task waits for its token, so a source has one poller at a time."""
        return self._locks.setdefault(source, asyncio.Lock())

    async def until_available(self, source: str) -> float:
        """Wait until the bucket of ``source`` holds a token (without taking it); returns the seconds waited."""
        started = time.monotonic()
        await self._sleep(self._next_send.get(source, 0.0) - started)
        while True:
            if self._closed.is_set():
                raise ShuttingDown(source)
            if source in self._halted:
                raise SourceHalted(source)
            if _count(await self._redis.get(tokens_key(source))) > 0:
                return time.monotonic() - started
            await self._sleep(self._poll_interval(source))

    async def take(self, source: str) -> bool:
        """Claim the source's send turn, then spend one token: True if the request may go now."""
        rate = self._rate_of(source)
        if rate:
            interval_ms = max(1, int(1000 / (rate * PACE_MARGIN)))
            if not await self._redis.set(send_pace_key(source), "1", px=interval_ms, nx=True):
                wait_ms = await self._redis.pttl(send_pace_key(source))
                self._next_send[source] = time.monotonic() + max(wait_ms, 1) / 1000
                return False
            self._next_send[source] = time.monotonic() + interval_ms / 1000
        return await self._redis.decr(tokens_key(source)) >= 0

    async def _sleep(self, seconds: float) -> None:
        """Sleep, but wake at once when the worker stops."""
        if seconds > 0:
            try:
                await asyncio.wait_for(self._closed.wait(), seconds)
            except asyncio.TimeoutError:
                pass

    def _poll_interval(self, source: str) -> float:
        rate = self._rate_of(source) or 0.0
        interval = TOKEN_POLL_MAX if rate <= 0 else min(TOKEN_POLL_MAX, max(TOKEN_POLL_MIN, 0.2 / rate))
        return interval * random.uniform(0.8, 1.2)  # workers sharing a source spread their polls

    def halt(self, sources: set[str]) -> None:
        """The sources whose waiting tasks should give up (``halted`` and ``temp_halted``)."""
        self._halted = sources

    def close(self) -> None:
        """Stop handing out tokens: waiting tasks get ShuttingDown at once."""
        self._closed.set()


def _count(raw) -> float:
    try:
        return float(raw)
    except (TypeError, ValueError):  # missing or garbled: no tokens (fail closed)
        return 0.0
