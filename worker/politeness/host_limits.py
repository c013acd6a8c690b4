"""Per-host concurrency cap: one slow site must not absorb every connection
a worker has, and no site should see more than a handful of parallel
requests from one crawler process."""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from collections.abc import AsyncIterator


class HostLimiter:
    """At most ``limit`` holders per host; idle hosts are forgotten so memory stays bounded."""

    def __init__(self, limit: int):
        self.limit = limit
        self._semaphores: dict[str, asyncio.Semaphore] = {}
        self._holders: dict[str, int] = {}

    @asynccontextmanager
    async def slot(self, host: str) -> AsyncIterator[None]:
        semaphore = self._semaphores.setdefault(host, asyncio.Semaphore(self.limit))
        self._holders[host] = self._holders.get(host, 0) + 1
        try:
            async with semaphore:
                yield
        finally:
            self._holders[host] -= 1
            if not self._holders[host]:
                del self._holders[host], self._semaphores[host]

    def in_use(self, host: str) -> int:
        """Holders and waiters for host (for tests and metrics)."""
        return self._holders.get(host, 0)

    def hosts(self) -> int:
        """Hosts remembered: only those with a holder or a waiter."""
        return len(self._semaphores)
