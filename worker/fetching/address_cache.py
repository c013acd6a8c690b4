"""A host's addresses, kept a few seconds for its next connections; one lookup a host at a time.

Each new connection needs its host's addresses, and a site's first requests open several at
once. The resolver runs in a thread (the loop must not block), so every lookup costs the
loop a hand-over and back. An answer is kept for ``DNS_CACHE_SECONDS``, as aiohttp's
connector keeps its own; a failed lookup is not kept. What is kept is what the resolver
answered, the SSRF guard's filter included, so a kept answer is one the guard passed.
"""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from worker.constants import DNS_CACHE_SECONDS
from worker.politeness.single_flight import SingleFlight
from worker.politeness.ttl_cache import TtlCache

Lookup = Callable[[str, int], Awaitable[list[str]]]


class AddressCache:
    def __init__(self, lookup: Lookup, clock: Callable[[], float] = time.monotonic,
                 seconds: float = DNS_CACHE_SECONDS):
        self._lookup = lookup
        self._seconds = seconds
        self._kept: TtlCache[tuple[str, int], list[str]] = TtlCache(clock)
        self._looking_up: SingleFlight[tuple[str, int], list[str]] = SingleFlight()

    async def addresses(self, host: str, port: int) -> list[str]:
        """The host's addresses; raises what the lookup raised (OSError, the guard's Refused)."""
        key = (host, port)
        kept = self._kept.get(key)
        if kept is not None:
            return kept
        return await self._looking_up.run(key, lambda: self._resolve(key))

    async def _resolve(self, key: tuple[str, int]) -> list[str]:
        answer = await self._lookup(*key)
        self._kept.put(key, answer, self._seconds)
        return answer
