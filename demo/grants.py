"""What the monitor granted each source while the demo crawled, so its table explains itself.

A source's achieved rate can sit far below its limit for two reasons: the adaptive back-off
allowed less (a new source starts at a tenth of its limit, and a slow site is slowed), or the
workers could not go faster. ``rate_limit:{source}`` holds what the monitor grants this
second (SPEC.md §2); a thread samples it while the crawl runs, and the summary averages the
samples over each source's busy span beside its limit.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import redis

from common.contracts import rate_limit_key

SAMPLE_SECONDS = 0.25


class GrantLog:
    """``with GrantLog(redis_url, sources) as grants:`` samples the grants until the block ends."""

    def __init__(self, redis_url: str, sources: Iterable[str]):
        self._client = redis.Redis.from_url(redis_url, decode_responses=True)
        self._sources = list(sources)
        self.samples: dict[str, list[tuple[float, float]]] = {s: [] for s in self._sources}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="grant-log", daemon=True)

    def __enter__(self) -> GrantLog:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._client.close()

    def _run(self) -> None:
        keys = [rate_limit_key(s) for s in self._sources]
        while not self._stop.wait(SAMPLE_SECONDS):
            try:
                values = self._client.mget(keys)
            except redis.RedisError:
                continue  # a sample missed; the stack is stopping or busy
            now = time.time()
            for source, value in zip(self._sources, values, strict=True):
                if value is not None:
                    self.samples[source].append((now, float(value)))

    def mean(self, source: str, since: float, until: float) -> float | None:
        """The mean grant over [since, until] (the nearest sample for a span shorter than a
        sample's interval); None if none was taken."""
        samples = self.samples.get(source, [])
        within = [rate for at, rate in samples if since <= at <= until]
        if within:
            return sum(within) / len(within)
        if not samples:
            return None
        return min(samples, key=lambda sample: abs(sample[0] - since))[1]
