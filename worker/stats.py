"""Per-outcome statistics in Redis (SPEC.md §2), read by the monitor's breakers and dashboards.

Each outcome is one pipeline (one round trip). Window scores are wall-clock
Unix seconds because every worker host writes the same sorted sets; members
carry a random suffix so two identical statuses in one instant both count.

Dropping the members that left a window (ZREMRANGEBYSCORE) is per source and
time, not per outcome: at most every STATS_TRIM_INTERVAL seconds a source's
windows are trimmed, in the same pipeline as its outcome. The breaker reads
the windows by score and trims them itself, so nothing it sees changes; a
set just holds at most that many seconds of members past its window, while
a busy source's outcome costs 7 commands instead of 10 (redis-py spends
about 30 us of the worker's event loop on each).
"""
from __future__ import annotations

import os
import time

from redis.exceptions import ResponseError

from common.contracts import EVENT_STATS_REJECTED
from common.contracts import (LAST_50_LENGTH, NUM_RESIZED, RESIZE_ERRORS, STATUS_WINDOWS,
                              errors_key, last_50_key, resized_key, status_window_key)
from common.jsonlog import log_event
from worker.constants import STATS_TRIM_INTERVAL


class Stats:
    def __init__(self, redis):
        self._redis = redis
        self._next_trim: dict[str, float] = {}  # source -> wall-clock time its windows are trimmed next

    async def record(self, source: str, status: str, success: bool, windows: bool = True) -> None:
        """Count an outcome; ``windows=False`` keeps it out of the breakers' windows (no request was made)."""
        pipe = self._redis.pipeline(transaction=False)
        if windows:
            now = time.time()
            member = f"{status}:{os.urandom(6).hex()}"
            trim = now >= self._next_trim.get(source, 0.0)
            if trim:
                self._next_trim[source] = now + STATS_TRIM_INTERVAL
            for prefix, seconds in STATUS_WINDOWS.items():
                key = status_window_key(prefix, source)
                pipe.zadd(key, {member: now})
                if trim:
                    pipe.zremrangebyscore(key, "-inf", now - seconds)
            pipe.rpush(last_50_key(source), status)
            pipe.ltrim(last_50_key(source), -LAST_50_LENGTH, -1)
        if success:
            pipe.incr(NUM_RESIZED)
            pipe.incr(resized_key(source))
        else:
            pipe.incr(RESIZE_ERRORS)
            pipe.incr(errors_key(source))
            pipe.incr(errors_key(source, status))
        try:
            await pipe.execute()
        except ResponseError as exc:  # e.g. an operator left a key of the wrong type: not worth a stall
            log_event(EVENT_STATS_REJECTED, source=source, status=status, error=str(exc)[:300])
