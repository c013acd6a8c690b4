"""Taking ``currtokens:{source}`` tokens before each request (SPEC 2 and 3).

The monitor refills each bucket once a second; a worker ``DECR``s it and may
fetch only if the result is >= 0. While a bucket is empty, only the first
waiting task of a source polls it (the others queue on a per-source lock),
at an interval that follows the source's rate: hundreds of tasks of a slow
source cost one ``DECR`` every few hundred milliseconds, not hundreds.
"""
from __future__ import annotations

import asyncio
import random
import time
from typing import Callable

from common.contracts import tokens_key
from worker.constants import TOKEN_POLL_MAX, TOKEN_POLL_MIN


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

    async def take(self, source: str) -> float:
        """Wait for one token of ``source``; returns the seconds spent waiting."""
        started = time.monotonic()
        lock = self._locks.setdefault(source, asyncio.Lock())
        async with lock:
            while True:
                if self._closed.is_set():
                    raise ShuttingDown(source)
                if source in self._halted:
                    raise SourceHalted(source)
                if await self._redis.decr(tokens_key(source)) >= 0:
                    return time.monotonic() - started
                try:
                    await asyncio.wait_for(self._closed.wait(), self._poll_interval(source))
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
