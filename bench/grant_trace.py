"""A site's grant beside what it was sent, in a real-shaped round (``--trace SITE``).

While this crawler's round runs, a thread reads ``adaptive:{source}`` of each traced site every
SAMPLE_SECONDS: the grant the back-off saved, whether it slow-starts, until when it drains. After
the round the site's own request log is laid beside it in bins of BIN_SECONDS from the round's
first image request: the grant at the bin's start and its phase, the image requests that arrived
in the bin, and their median time at the site (queueing for a slot, then service).
"""
from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import redis

from common import contracts
from demo.simweb import RequestRecord, fetches

SAMPLE_SECONDS = 0.25
BIN_SECONDS = 0.5


@dataclass(frozen=True)
class Sample:
    time: float                # wall clock
    rate: float                # req/s granted (effective_rate)
    slow_start: bool
    drain_until: float | None  # wall clock


@dataclass(frozen=True)
class Row:
    at: float                  # seconds after the first image request, the bin's start
    grant: float | None        # the latest sample at the bin's start; None before the first
    phase: str                 # "start" (slow start), "drain", "steps" (AIMD) or "-"
    sent: int
    median_ms: float | None


def phase(sample: Sample | None, at: float) -> str:
    if sample is None:
        return "-"
    if sample.slow_start:
        return "start"
    return "drain" if sample.drain_until is not None and at < sample.drain_until else "steps"


def trace_rows(samples: Iterable[Sample], requests: Iterable[RequestRecord], first: float,
               bin_seconds: float = BIN_SECONDS) -> list[Row]:
    """Bins from ``first`` (wall clock) to the site's last image request."""
    images = sorted(fetches(requests), key=lambda r: r.time)
    ordered = sorted(samples, key=lambda s: s.time)
    if not images:
        return []
    rows, index, latest = [], 0, None
    for n in range(int((images[-1].time - first) // bin_seconds) + 1):
        start = first + n * bin_seconds
        while index < len(ordered) and ordered[index].time <= start:
            latest, index = ordered[index], index + 1
        arrived = [r.served_in * 1000 for r in images if start <= r.time < start + bin_seconds]
        rows.append(Row(n * bin_seconds, latest.rate if latest else None, phase(latest, start), len(arrived),
                        statistics.median(arrived) if arrived else None))
    return rows


def format_rows(site: str, rows: list[Row]) -> list[str]:
    lines = [f"  {site}: s after the first image request, grant req/s and phase, requests, median ms at the site"]
    for row in rows:
        grant = "-" if row.grant is None else f"{row.grant:.1f}"
        median = "-" if row.median_ms is None else f"{row.median_ms:.0f}"
        lines.append(f"    {row.at:5.1f} {grant:>6} {row.phase:<6}{row.sent:>4}{median:>7}")
    return lines


class GrantSampler:
    """Reads ``adaptive:{source}`` of ``sources`` every SAMPLE_SECONDS in a thread, until closed."""

    def __init__(self, redis_url: str, sources: Iterable[str]):
        self._redis = redis.Redis.from_url(redis_url)
        self.samples: dict[str, list[Sample]] = {source: [] for source in sources}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="grant-trace", daemon=True)

    def __enter__(self) -> GrantSampler:
        if self.samples:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._redis.close()

    def _run(self) -> None:
        fields = ("effective_rate", contracts.ADAPTIVE_SLOW_START_FIELD, "drain_until")
        while not self._stop.wait(SAMPLE_SECONDS):
            pipe = self._redis.pipeline(transaction=False)
            for source in self.samples:
                pipe.hmget(contracts.adaptive_key(source), fields)
            try:
                values = pipe.execute()
            except redis.RedisError:
                continue  # the stack starting or stopping
            now = time.time()
            for kept, (rate, slow_start, drain_until) in zip(self.samples.values(), values, strict=True):
                if rate is not None:
                    kept.append(Sample(now, float(rate), slow_start == b"1",
                                       None if drain_until is None else float(drain_until)))
