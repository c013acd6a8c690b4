"""One active monitor per cluster: a lease in Redis, renewed every second.

Two monitors at once would refill every bucket twice a second (twice the
rate a site agreed to) and split every inbound message twice. With the
lease, a second monitor waits as a standby and takes over within
``LEASE_TTL_MS`` of the first one's death; a graceful stop hands over at
once. The splitter relies on it: it reads ``inbound_images`` with fixed
partition assignments, not a consumer group, because a group join costs
seconds at every start and the lease already guarantees a single reader.
"""
from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Callable

from common import contracts
from common.jsonlog import log_event
from common.protocols import AsyncRedis
from crawl_monitor.constants import LEASE_RENEW_SECONDS, LEASE_TTL_MS
from crawl_monitor.periodic import Fatal

# Extend our own lease (1); take it again if it vanished (2: Redis restarted empty);
# report 0 if someone else holds it.
_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
elseif not holder then
  return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) and 2 or 0
end
return 0
"""
RETAKEN = 2
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaseLost(Fatal):
    """Another monitor holds the lease now: this one must stop at once."""


def holder_name() -> str:
    """Readable for the operator (host and pid), unique across restarts (the suffix)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class MonitorLease:
    def __init__(self, redis: AsyncRedis, holder: str | None = None, ttl_ms: int = LEASE_TTL_MS):
        self._redis = redis
        self.on_emptied: Callable[[], None] = lambda: None  # Redis lost its data: what the monitor wrote is gone
        self.holder = holder or holder_name()
        self._ttl_ms = ttl_ms
        self._renew = redis.register_script(_RENEW)
        self._release = redis.register_script(_RELEASE)

    async def acquire(self, retry_seconds: float = LEASE_RENEW_SECONDS) -> None:
        """Wait until the lease is ours, logging once that we are a standby (and whom we wait for)."""
        waiting_for = None
        while True:
            try:
                if await self._redis.set(contracts.MONITOR_LEASE, self.holder, nx=True, px=self._ttl_ms):
                    if waiting_for is not None:
                        log_event(contracts.EVENT_MONITOR_LEASE_TAKEN, holder=self.holder, previous=waiting_for)
                    return
                current = await self._redis.get(contracts.MONITOR_LEASE)
            except Exception as exc:  # noqa: BLE001 - Redis away: nobody can regulate; keep asking
                current = f"unknown ({type(exc).__name__}: {exc})"
            if current is not None and current != waiting_for:
                log_event(contracts.EVENT_MONITOR_STANDBY, holder=self.holder, active=current)
                waiting_for = current
            await asyncio.sleep(retry_seconds)

    async def renew(self) -> None:
        """Called every second (``periodic.every``, which logs a Redis error and tries again the
        next second: the lease outlives a few misses); raises ``LeaseLost`` if another monitor
        took over meanwhile, which ends the monitor. A lease that vanished (Redis restarted
        empty) is taken again, and ``on_emptied`` told: keys the monitor writes only when they
        change must be written again."""
        renewed = await self._renew(keys=[contracts.MONITOR_LEASE], args=[self.holder, self._ttl_ms])
        if not renewed:
            raise LeaseLost(f"monitor lease now held by {await self._redis.get(contracts.MONITOR_LEASE)!r}")
        if renewed == RETAKEN:
            self.on_emptied()

    async def release(self) -> None:
        """Hand over at once on a graceful stop, instead of making a standby wait for the expiry."""
        await self._release(keys=[contracts.MONITOR_LEASE], args=[self.holder])
