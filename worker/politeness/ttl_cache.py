"""A small in-process cache with expiry, so per-URL checks (robots rules,
address verdicts) skip Redis and DNS while memory stays bounded however many
hosts a long crawl meets: least recently used entries go first past a count
and, where entries say what they cost, past a byte budget; an expired entry
is dropped when read, and all of them by a sweep at most once a minute."""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Generic, TypeVar
from collections.abc import Callable, Hashable

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

MAX_ITEMS = 10_000
SWEEP_SECONDS = 60.0


class TtlCache(Generic[K, V]):
    def __init__(self, clock: Callable[[], float] = time.monotonic, max_items: int = MAX_ITEMS,
                 max_bytes: int | None = None):
        self._clock = clock
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._items: OrderedDict[K, tuple[float, V, int]] = OrderedDict()  # oldest use first
        self.nbytes = 0  # the sizes of the entries held, as put() was told them
        self._next_sweep = clock() + SWEEP_SECONDS

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: K) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        if item[0] <= self._clock():
            self._drop(key)
            return None
        self._items.move_to_end(key)
        return item[1]

    def put(self, key: K, value: V, ttl: float, size: int = 0) -> None:
        """Keep ``value`` for ``ttl`` seconds; ``size``: its cost against ``max_bytes``."""
        if key in self._items:
            self._drop(key)
        if ttl <= 0 or (self._max_bytes is not None and size > self._max_bytes):
            return
        now = self._clock()
        self._items[key] = (now + ttl, value, size)
        self.nbytes += size
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_SECONDS
            for expired in [k for k, item in self._items.items() if item[0] <= now]:
                self._drop(expired)
        while len(self._items) > self._max_items or (
                self._max_bytes is not None and self.nbytes > self._max_bytes):
            self._drop(next(iter(self._items)))

    def _drop(self, key: K) -> None:
        self.nbytes -= self._items.pop(key)[2]
