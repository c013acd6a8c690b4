"""One load per key at a time: a caller asking while it runs waits for the same answer.

A caller's cancellation (its timeout) ends its own wait, not the load others wait on. A failure
reaches every waiter, and is retrieved: every waiter may have gone.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlight(Generic[K, V]):
    def __init__(self) -> None:
        self._running: dict[K, asyncio.Future[V]] = {}

    async def run(self, key: K, load: Callable[[], Awaitable[V]]) -> V:
        """``load()``'s answer, from the load of ``key`` already running if there is one."""
        running = self._running.get(key)
        if running is None:
            running = asyncio.ensure_future(load())
            self._running[key] = running
            running.add_done_callback(lambda done: self._settled(key, done))
        return await asyncio.shield(running)

    def _settled(self, key: K, done: asyncio.Future[V]) -> None:
        self._running.pop(key, None)
        if not done.cancelled():
            done.exception()
