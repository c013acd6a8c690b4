"""Crawl-delay across the cluster: a host asking for N seconds between
requests gets N seconds between requests from all workers together, not N
per worker.

Requests to such a host take turns: ``crawl_delay_next:{origin}`` holds the
wall-clock time before which no worker may start one. A worker claims its
turn at the moment it sends (the key then holds a lease, so nobody starts
while it is in flight) and, when the response is in, sets the key to now +
delay. The gap the site sees is therefore at least the delay whatever the
load on the workers: the next request starts only after the previous one's
response was received.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from collections.abc import AsyncIterator, Callable

from common.contracts import crawl_delay_key

LEASE_SECONDS = 120.0   # a worker dying mid-request blocks its host this long at most
POLL_SECONDS = 0.25     # waiters cannot know when an in-flight request ends

# Claim the turn if it is free (return "0" and store the lease), else say how long to wait.
_CLAIM = """
local now = tonumber(ARGV[1])
local next_free = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
if now >= next_free then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return '0'
end
return string.format('%.6f', next_free - now)
"""
# End our turn, unless our lease expired and someone else holds the key now.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
return 0
"""


class CrawlDelay:
    def __init__(self, redis, clock: Callable[[], float] = time.time):
        self._redis = redis
        self._clock = clock

    @asynccontextmanager
    async def turn(self, origin: str, delay: float) -> AsyncIterator[None]:
        """Hold origin's turn for the request inside; no-op when delay is 0."""
        if delay <= 0:
            yield
            return
        key = crawl_delay_key(origin)
        lease = await self._claim(key)
        try:
            yield
        finally:
            done = self._clock() + delay
            await self._redis.eval(_RELEASE, 1, key, lease, f"{done:.6f}", int(delay * 1000) + 60_000)

    async def _claim(self, key: str) -> str:
        while True:
            lease = f"{self._clock() + LEASE_SECONDS:.6f}"
            wait = float(await self._redis.eval(
                _CLAIM, 1, key, repr(self._clock()), lease, int(LEASE_SECONDS * 1000)))
            if wait <= 0:
                return lease
            await asyncio.sleep(min(wait, POLL_SECONDS))
