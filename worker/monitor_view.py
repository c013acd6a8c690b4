"""What the monitor decided, as this worker last read it: halts, rates and slow-start limits.

One object per worker, refreshed from Redis by the scheduler (``refresh``) and read by the
scheduler, the token buckets (the pace of their polls, the halts that end a token wait) and
the halted line (which sources may come back). A rate missing from Redis (restarted empty,
say) keeps its last known value: forgetting it would stop the pacing.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping

from common.contracts import ADAPTIVE_CEILING_FIELD, ADAPTIVE_SLOW_START_FIELD, adaptive_key, rate_limit_key
from common.protocols import AsyncRedis
from common.redis_values import non_negative
from common.source_sets import read_source_sets


class MonitorView:
    def __init__(self, rates: Mapping[str, float] | None = None, halted: Collection[str] = (),
                 temp_halted: Collection[str] = (), stopped: Collection[str] = (), judged: Collection[str] = ()):
        """The decisions known so far (none, for a worker; given, for a test or a bench)."""
        self._rates: dict[str, float] = dict(rates or {})  # source -> rate_limit:{source}
        self._limits: dict[str, float] = {}  # source -> its limit, while it slow-starts
        self._judged: set[str] = set(judged)  # sources whose adaptive state the monitor has saved
        self._halted = frozenset(halted)
        self._temp_halted = frozenset(temp_halted)
        self._stopped = frozenset(stopped) | self._halted | self._temp_halted

    @property
    def halted(self) -> frozenset[str]:
        """Halted by the breaker: parked in ``urls_halted`` until resumed."""
        return self._halted

    @property
    def temp_halted(self) -> frozenset[str]:
        """Temporarily halted: parked for a turn."""
        return self._temp_halted

    @property
    def stopped(self) -> frozenset[str]:
        """Halted, temporarily halted or paused: a task waiting for a token gives up."""
        return self._stopped

    def rate(self, source: str) -> float | None:
        """The source's rate (what it is granted now), or None if not read yet."""
        return self._rates.get(source)

    def paused(self) -> set[str]:
        """The sources whose rate is 0 (a Retry-After pause, a halt)."""
        return {source for source, rate in self._rates.items() if rate <= 0}

    def slow_start_limit(self, source: str) -> float | None:
        """The source's limit while it slow-starts (its grant is about to climb to it), else None."""
        return self._limits.get(source)

    def judged(self, source: str) -> bool:
        """Whether the monitor has saved its judgment of the source (its adaptive state)."""
        return source in self._judged

    def sources_known(self) -> int:
        """How many sources' rates are known."""
        return len(self._rates)

    async def refresh(self, redis: AsyncRedis, working: list[str], fresh: list[str]) -> None:
        """Read the halts, the rates of ``working`` and the adaptive states of ``fresh``. Redis not
        answering raises, and the last state is kept."""
        sets = await read_source_sets(redis, inbound=False)
        rates = await redis.mget([rate_limit_key(s) for s in working]) if working else []
        states = []
        if fresh:
            pipe = redis.pipeline(transaction=False)
            for source in fresh:
                pipe.hmget(adaptive_key(source), [ADAPTIVE_CEILING_FIELD, ADAPTIVE_SLOW_START_FIELD])
            states = await pipe.execute()
        for source, (limit, slow_start) in zip(fresh, states, strict=True):
            # Only while it slow-starts is its grant about to climb to its limit; a source backed
            # off is crawled at its grant.
            ceiling = non_negative(limit)
            if ceiling is None:  # the monitor has not judged it yet
                self._judged.discard(source)
            else:
                self._judged.add(source)
            if ceiling is not None and str(slow_start) == "1":
                self._limits[source] = ceiling
            else:
                self._limits.pop(source, None)
        self._halted, self._temp_halted, self._stopped = sets.halted, sets.temp_halted, sets.stopped
        self._rates.update({source: rate for source, raw in zip(working, rates, strict=True)
                            if (rate := non_negative(raw)) is not None})

    async def potential(self, redis: AsyncRedis, sources: list[str]) -> dict[str, float]:
        """What each of ``sources`` may be granted, as Redis says now: its rate, or its limit (the
        monitor's ceiling for it) if higher, for a source not crawled here whose rate key may have
        expired; a source with neither is left out. Nothing is kept. Redis not answering raises."""
        rates = await redis.mget([rate_limit_key(s) for s in sources])
        pipe = redis.pipeline(transaction=False)
        for source in sources:
            pipe.hmget(adaptive_key(source), [ADAPTIVE_CEILING_FIELD])
        ceilings = await pipe.execute()
        found: dict[str, float] = {}
        for source, raw, (ceiling,) in zip(sources, rates, ceilings, strict=True):
            known = [value for value in (non_negative(raw), non_negative(ceiling)) if value is not None]
            if known:
                found[source] = max(known)
        return found

    def saw_rate(self, source: str, rate: float | None) -> None:
        """A source's rate read with its token (``rate_limit:{source}``, newer than the last refresh);
        None (missing or unreadable) changes nothing."""
        if rate is not None:
            self._rates[source] = rate

    def decide(self, rates: Mapping[str, float] | None = None, halted: Collection[str] | None = None) -> None:
        """Decisions set by hand, as the monitor would: for tests and benches without one."""
        self._rates.update(rates or {})
        if halted is not None:
            self._halted = frozenset(halted)
            self._stopped = self._halted | self._temp_halted

    def forget(self, keep: Collection[str]) -> None:
        """Drop what is known of every source not in ``keep``."""
        self._rates = {s: r for s, r in self._rates.items() if s in keep}
        self._limits = {s: v for s, v in self._limits.items() if s in keep}
        self._judged.intersection_update(keep)
