"""Each source's state as Redis holds it: counters, limits, halts.

Read by the dashboard's ``/metrics`` and ``/status`` and by ``python -m crawl_monitor.ctl``,
so the operator's CLI does not import the web server to read it.
"""
from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from redis.asyncio import Redis

from common.contracts import (ADAPTIVE_CEILING_FIELD, ADAPTIVE_LIMIT_FIELD, adaptive_key, adaptive_off_key,
                              error_statuses_key, errors_key,
                              override_rate_key, rate_limit_key, resized_key, source_requests_key, tokens_key,
                              opted_out_key, urls_ended_key, urls_split_key)
from common.redis_values import as_text, count, finite_number
from common.source_sets import read_source_sets, stopped_among
from crawl_monitor.active_sources import Rereads, wanting_scores, wanting_since
from crawl_monitor.batched_keys import KEYS_BATCH, BatchedKeys
from crawl_monitor.constants import SHOWN_RECENT_SECONDS


@dataclass
class SourceState:
    """One source as Redis sees it now; shared by /metrics, /status and ``ctl status``."""
    requests: int = 0
    successes: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    rate_limit: float | None = None
    override: float | None = None
    tokens: int | None = None
    halted: bool = False
    temp_halted: bool = False
    # The adaptive back-off (adaptive:{source}): the source's limit (computed or overridden),
    # the most it may grant (the limit, or capacity discovery's ceiling), what it allows now,
    # and the response times it judges by.
    limit: float | None = None
    ceiling: float | None = None
    effective_rate: float | None = None
    baseline_ms: float | None = None
    recent_ms: float | None = None
    adaptive: bool = True  # False while adaptive_off:{source} is set
    # URLs split and not yet ended (urls_split - urls_ended): what waits for the source, halted
    # or not (no topic per source shows it as lag).
    backlog: int = 0
    # URLs its site opted out of, by signal (opted_out:{source}; SPEC.md §1 opted_out).
    opted_out: dict[str, int] = field(default_factory=dict)

    @property
    def error_total(self) -> int:
        return sum(self.errors.values())



MAX_SIGNALS = 16  # fields of an opted_out hash read: workers write seven; a line stays bounded


def signal_counts(raw: dict | None) -> dict[str, int]:
    """An ``opted_out[:{source}]`` hash as {signal: URLs}; a field that is no count is left out."""
    counts = {as_text(k)[:64]: count(v) for k, v in list((raw or {}).items())[:MAX_SIGNALS]}
    return {signal: n for signal, n in sorted(counts.items()) if n > 0}


def backlog(split: object, ended: object) -> int:
    """``urls_split - urls_ended``, never below 0: a URL ended twice (at-least-once) or split
    before the counters existed must not make a source look as if it owed URLs."""
    return max(0, count(split) - count(ended))


async def _read_errors(redis: Redis, batched: BatchedKeys, sources: list[str]) -> dict[str, dict[str, int]]:
    """Failures by status, from keys it can name: each source's ``error_statuses`` set
    says which counters exist (a SCAN would walk every key, one per robots.txt host too)."""
    statuses = [sorted(map(as_text, members)) for members in await batched.sets(list(map(error_statuses_key, sources)))]
    keys = [errors_key(source, status) for source, named in zip(sources, statuses, strict=True) for status in named]
    values = iter(await redis.mget(keys) if keys else [])
    return {source: {status: count(next(values)) for status in named}
            for source, named in zip(sources, statuses, strict=True)}


# SourceState's fields read from adaptive:{source}, under the same names there.
_ADAPTIVE_FIELDS = (ADAPTIVE_LIMIT_FIELD, ADAPTIVE_CEILING_FIELD, "effective_rate", "baseline_ms", "recent_ms")


def _whole(number: float | None) -> int | None:
    return None if number is None else int(number)


async def shown_sources(redis: Redis, now: float, most: int | None = None) -> list[str]:
    """The sources the dashboard and ``/metrics`` show: those active in the last
    SHOWN_RECENT_SECONDS and every halted or paused one, not every source ever seen; with ``most``,
    at most that many: the stopped first, then the most recently active (docs/decisions.md,
    "Fleet scale")."""
    sets = await read_source_sets(redis, inbound=False)
    since = now - SHOWN_RECENT_SECONDS
    if most is None:
        return sorted(await wanting_since(redis, since) | sets.stopped)
    stopped = sorted(sets.stopped)[:most]
    latest = await wanting_scores(redis, since, most)
    recent = heapq.nsmallest(most - len(stopped), (s for s in latest if s not in sets.stopped),
                             key=lambda s: (-latest[s], s))
    return sorted(stopped + recent)


async def read_sources(redis: Redis, among: list[str] | None = None) -> dict[str, SourceState]:
    """Every source in ``inbound_sources`` (or only those ``among``) with its counters, limits and halts:
    one MGET per key kind, their adaptive states, opt-outs and failures by status by script."""
    if among is None:
        sets = await read_source_sets(redis)
        sources, halted, temp_halted = sorted(sets.inbound), sets.halted, sets.temp_halted
    else:
        sources = sorted(among)
        halted, temp_halted = await stopped_among(redis, sources)
    if not sources:
        return {}
    kinds = (source_requests_key, resized_key, rate_limit_key, override_rate_key, tokens_key, adaptive_off_key,
             urls_split_key, urls_ended_key)
    pipe = redis.pipeline(transaction=False)
    for key_of in kinds:
        pipe.mget([key_of(source) for source in sources])
    columns = await pipe.execute()
    keys = BatchedKeys(redis)
    hashes = await keys.hashes([adaptive_key(source) for source in sources]
                               + [opted_out_key(source) for source in sources])
    adaptive_states, opted_out_states = hashes[:len(sources)], hashes[len(sources):]
    errors = await _read_errors(redis, keys, sources)
    states = {}
    for source, requests, successes, rate, override, tokens, off, split, ended, adaptive_state, opted_out in zip(
            sources, *columns, adaptive_states, opted_out_states, strict=True):
        adaptive = {as_text(k): finite_number(v) for k, v in adaptive_state.items()}
        states[source] = SourceState(
            requests=count(requests), successes=count(successes),
            errors=errors[source],
            rate_limit=finite_number(rate), override=finite_number(override),
            tokens=_whole(finite_number(tokens)),
            halted=source in halted, temp_halted=source in temp_halted,
            **{name: adaptive.get(name) for name in _ADAPTIVE_FIELDS},
            adaptive=off is None,
            backlog=backlog(split, ended),
            opted_out=signal_counts(opted_out),
        )
    return states  # in name order


class ChartReads:
    """What the dashboard's chart samples every 5 s (``http_api.History``): each shown source's
    requests and granted rate, the other fields left at their defaults (the rest of a state is read
    when ``/status`` or ``/metrics`` asks: ``read_sources``).

    The work follows the sources with news, not those shown (docs/decisions.md, "Fleet scale"):
    every shown source is read each
    ACTIVE_SOURCES_FULL_READ_SECONDS, and between, only those ``Rereads`` names (two MGETs), a new
    one added. A quiet source keeps its last state until the next full read, so its expiring rate
    shows up to a minute late. A read asks KEYS_BATCH sources at a time, so the monitor's loop
    (the buckets' refill) runs between them (docs/decisions.md, "Fleet scale")."""

    def __init__(self, redis: Redis, clock: Callable[[], float] = time.time):
        self._redis = redis
        self._clock = clock
        self._rereads = Rereads(clock)
        self.states: dict[str, SourceState] = {}  # every shown source's latest read

    async def sample(self) -> set[str] | None:
        """Read what is due into ``states``; return the sources read, or None for a full read (every
        shown source read, those no longer shown dropped)."""
        due = await self._rereads.due(self._redis)
        names = await shown_sources(self._redis, self._clock()) if due is None else sorted(due)
        read: dict[str, SourceState] = {}
        for start in range(0, len(names), KEYS_BATCH):
            batch = names[start:start + KEYS_BATCH]
            # At once, on the client's pipelined connection (redis-py's pipeline packed each key).
            requests, rates = await asyncio.gather(self._redis.mget([source_requests_key(source) for source in batch]),
                                                   self._redis.mget([rate_limit_key(source) for source in batch]))
            read.update((source, SourceState(requests=count(sent), rate_limit=finite_number(rate)))
                        for source, sent, rate in zip(batch, requests, rates, strict=True))
        if due is None:
            self.states = read
            return None
        self.states.update(read)
        return set(read)
