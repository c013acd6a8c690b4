"""A small in-process cache with expiry, so per-URL checks (robots rules,
address verdicts) skip Redis and DNS while memory stays bounded however many
hosts a long crawl meets."""
from __future__ import annotations

import time
from typing import Generic, TypeVar
from collections.abc import Callable, Hashable

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

MAX_ITEMS = 10_000


class TtlCache(Generic[K, V]):
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_items: int = MAX_ITEMS):
        self._clock = clock
        self._max_items = max_items
        self._items: dict[K, tuple[float, V]] = {}

    def get(self, key: K) -> V | None:
        item = self._items.get(key)
        if item is None or item[0] <= self._clock():
            return None
        return item[1]

    def put(self, key: K, value: V, ttl: float) -> None:
        if ttl <= 0:
            return
        if len(self._items) >= self._max_items:
            now = self._clock()
            self._items = {k: v for k, v in self._items.items() if v[0] > now}
            while len(self._items) >= self._max_items:  # all live: drop the oldest
                del self._items[next(iter(self._items))]
        self._items[key] = (self._clock() + ttl, value)
