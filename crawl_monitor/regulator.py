"""The rate-limit regulator: every active source's token bucket, refilled once a second.

Workers ``DECR currtokens:{source}`` before each request and fetch only on a
result >= 0, so the bucket's value each second *is* the source's rate. The
bucket is SET, never incremented: a token unused within its second is gone
rather than saved up into a burst. Each SET carries a short expiry, so a
dead monitor leaves empty buckets behind and the crawl stops (fail closed).

Only the sources active lately (``ACTIVE_SOURCES_TICK_SECONDS``: an outcome in
``active_sources``, a split or a worker waiting for its tokens in ``waiting_sources``) are
ticked: a second's work is in proportion to the sources being crawled, not to those seen
(docs/decisions.md). A source that drops out has nothing to crawl; its bucket and rate
expire within seconds.
"""
from __future__ import annotations

import asyncio
import math
import zlib
from datetime import datetime, UTC

from common import contracts
from common.jsonlog import log_event
from common.source_sets import stopped_among
from common.redis_values import non_negative
from common.protocols import AsyncRedis
from common.settings import DISCOVERY_ALL, DISCOVERY_LISTS, DISCOVERY_NONE
from crawl_monitor.active_sources import wanting_since
from crawl_monitor.adaptive import Adaptation
from crawl_monitor.constants import (ACTIVE_SOURCES_TICK_SECONDS, BUCKET_TTL_MS, LIST_SIZES_REFRESH_SECONDS,
                                     MAX_RETRY_AFTER_SECONDS, RATE_LIMIT_REWRITE_SECONDS,
                                     RATE_LIMIT_TTL_SECONDS, REFILL_BATCH, UNKNOWN_SOURCE_REPORT_SECONDS)
from crawl_monitor.sources import rate_for_size

# KEYS: n sources' buckets, then the rate_limit keys written this tick; ARGV: the buckets' expiry
# (ms), the rates' expiry (s), n, the n grants, then the rates written.
REFILL = """
local n = tonumber(ARGV[3])
for i = 1, n do
  redis.call('SET', KEYS[i], ARGV[3 + i], 'PX', ARGV[1])
end
for i = n + 1, #KEYS do
  redis.call('SET', KEYS[i], ARGV[3 + i], 'EX', ARGV[2])
end
return n
"""

# Float sums such as 0.1 * 10 land a hair under the whole number they mean.
_EPSILON = 1e-9

# Where a source's limit comes from (``Regulator._configured_rate``).
OVERRIDE, CATALOG, LIST, DEFAULT = "override", "catalog", "list", "default"


def rate_due(rate: float, written: tuple[float, float] | None, now: float) -> bool:
    """Whether a tick writes a source's ``rate_limit:{source}``, last ``written`` as (rate, when;
    None: not by this regulator, or not since it was last ticked): when its rate changed, or when
    it was written RATE_LIMIT_REWRITE_SECONDS ago, so it never expires while the source is ticked."""
    return written is None or written[0] != rate or now - written[1] >= RATE_LIMIT_REWRITE_SECONDS


def discovery_cap(kind: str, limit: float, sources: str, max_rate: float) -> float | None:
    """The most capacity discovery may grant a source whose ``limit`` comes from ``kind``, or None
    when it may not discover: never past an override, nor a catalog source unless ``sources`` is
    ``all``; never below the limit itself."""
    if kind == OVERRIDE or sources == DISCOVERY_NONE or (kind == CATALOG and sources != DISCOVERY_ALL):
        return None
    assert sources in (DISCOVERY_LISTS, DISCOVERY_ALL), sources
    return max(limit, max_rate)


class Regulator:
    """Decides each source's tokens for the coming second and writes them to Redis.

    Rate precedence: an operator's ``override_rate:{source}`` wins over the
    rate computed from the source's size in SOURCES_URL, which wins over the rate
    computed from its count of URLs in the lists produced (``list_source_sizes``),
    which wins over ``DEFAULT_SOURCE_RATE``; a source with none of them
    gets nothing and is reported. A halted, temporarily halted or Retry-After-paused source
    gets an explicit 0 whatever its rate. Any other is granted what ``adaptation`` (the
    adaptive back-off, ``crawl_monitor.adaptive``) makes of its rate, if there is one; a
    source that may discover its capacity (``discovery_sources``: DISCOVERY_SOURCES) up to
    ``discovery_max_rate`` while its site answers at its unloaded speed.
    """

    def __init__(self, redis: AsyncRedis, adaptation: Adaptation | None = None,
                 default_rate: float | None = None, discovery_max_rate: float = 0.0,
                 discovery_sources: str = DISCOVERY_NONE):
        self._redis = redis
        self._refill = redis.register_script(REFILL)
        self._adaptation = adaptation
        self._default_rate = default_rate
        self._discovery = (discovery_sources, discovery_max_rate)
        self._computed: dict[str, float] = {}
        # From list_source_sizes: a source is looked up there the first second it has URLs and
        # no size in SOURCES_URL, and every LIST_SIZES_REFRESH_SECONDS after (a list being
        # produced adds to its count).
        self._from_lists: dict[str, float] = {}
        self._lists_read_at = 0.0
        # Fractional tokens carried to the next second: 0.5 req/s gives 0, 1, 0, 1...
        # and 1.5 req/s gives 1, 2, 1, 2..., so every average is exact.
        self._credit: dict[str, float] = {}
        self._pauses: dict[str, tuple[str, float]] = {}  # source -> (raw key value, paused until)
        self._reported_bad: dict[str, str] = {}          # Redis key -> unusable value already reported
        self._unknown_reported_at: dict[str, float] = {}
        self.rates: dict[str, float] = {}                # effective rates granted by the last tick
        self._limits: dict[str, float] = {}              # configured rates (override or size) seen by ticks
        self._caps: dict[str, float] = {}                # of those that may discover: the most they may get
        self._rates_written: dict[str, tuple[float, float]] = {}  # rate_limit:{source} as last written, and when

    def set_sizes(self, sizes: dict[str, int]) -> None:
        """Adopt a freshly loaded sources list (source -> image count)."""
        self._computed = {source: rate_for_size(count) for source, count in sizes.items()}

    async def tick(self, now: float) -> dict[str, int]:
        """Set the bucket of every source active lately, for the second starting at ``now``
        (Unix time); return the grants. Reads and writes only those sources' keys."""
        sources = sorted(await wanting_since(self._redis, now - ACTIVE_SOURCES_TICK_SECONDS))
        self._forget_others(sources, now)
        if not sources:
            self.rates = {}
            return {}
        halted, temp_halted = await stopped_among(self._redis, sources)
        # A source sized by a URL list is looked up the second it is active, then every
        # LIST_SIZES_REFRESH_SECONDS (the list's counts grow while it is produced).
        lookup = [s for s in sources if s not in self._computed and s not in self._from_lists]
        if now - self._lists_read_at >= LIST_SIZES_REFRESH_SECONDS:
            lookup += list(self._from_lists)
            self._lists_read_at = now
        # At once, the MGETs on the client's pipelined connection (redis-py's pipeline packed each key).
        reads = [self._redis.mget([contracts.override_rate_key(s) for s in sources]),
                 self._redis.mget([contracts.retry_after_key(s) for s in sources])]
        if lookup:
            reads.append(self._redis.hmget(contracts.LIST_SOURCE_SIZES, lookup))
        overrides, retry_afters, *counts = await asyncio.gather(*reads)
        if lookup:
            self._adopt_list_sizes(lookup, counts[0])

        configured: dict[str, float | None] = {}
        held: set[str] = set()  # halted, temporarily halted or paused: 0 whatever its rate
        for source, override, retry_after in zip(sources, overrides, retry_afters, strict=True):
            rate, kind = self._configured_rate(source, override)
            configured[source] = rate
            if rate is not None:
                self._limits[source] = rate
                cap = None if self._adaptation is None else discovery_cap(kind, rate, *self._discovery)
                if cap is None:
                    self._caps.pop(source, None)
                else:
                    self._caps[source] = cap
                if source in halted or source in temp_halted or self._paused(source, retry_after, now):
                    held.add(source)
        if self._adaptation is not None:
            await self._adaptation.meet([s for s, rate in configured.items() if rate is not None and s not in held])

        grants: dict[str, int] = {}
        rates: dict[str, float] = {}
        for source, limit in configured.items():
            if limit is None:
                self._report_unknown(source, now)
                rate = 0.0
            elif source in held:
                rate = 0.0
            else:
                rate = (limit if self._adaptation is None
                        else self._adaptation.effective(source, limit, self._caps.get(source)))
            grants[source] = self._take_tokens(source, rate)
            rates[source] = rate

        await self._write(grants, rates, now)
        self.rates = rates
        return grants

    def _forget_others(self, sources: list[str], now: float) -> None:
        """What is kept per source follows the sources ticked, not every source ever seen."""
        ticked = set(sources)
        self._credit = {s: credit for s, credit in self._credit.items() if s in ticked}
        self._limits = {s: limit for s, limit in self._limits.items() if s in ticked}
        self._caps = {s: cap for s, cap in self._caps.items() if s in ticked}
        self._from_lists = {s: rate for s, rate in self._from_lists.items() if s in ticked}
        self._rates_written = {s: written for s, written in self._rates_written.items() if s in ticked}
        self._pauses = {s: pause for s, pause in self._pauses.items() if s in ticked or pause[1] > now}
        self._unknown_reported_at = {s: at for s, at in self._unknown_reported_at.items()
                                     if now - at < UNKNOWN_SOURCE_REPORT_SECONDS}

    def limit_of(self, source: str) -> float | None:
        """The most the source may be granted (capacity discovery's ceiling, else its override or
        its size's rate), for the splitter to spread its URLs by: a worker crawls one partition at
        most at its own speed; None for a source never ticked and not in the sources list. Read
        from the splitter's thread: dict lookups, no state changed."""
        limit = self._caps.get(source, self._limits.get(source))
        if limit is not None:
            return limit
        computed = self._computed.get(source)
        kind, size_rate = (LIST, 0.0) if computed is None else (CATALOG, computed)
        cap = None if self._adaptation is None else discovery_cap(kind, size_rate, *self._discovery)
        return computed if cap is None else cap

    def _adopt_list_sizes(self, sources: list[str], counts: list[str | None]) -> None:
        for source, count in zip(sources, counts, strict=True):
            size = non_negative(count) if count is not None else None
            if size is None:
                self._from_lists.pop(source, None)
            else:
                self._from_lists[source] = rate_for_size(int(size))

    async def _write(self, grants: dict[str, int], rates: dict[str, float], now: float) -> None:
        """The buckets, and the rates that changed or are due again (``rate_due``: a one-URL site
        is ticked ~5 times at one rate), REFILL_BATCH sources per script call: one pipeline of
        every source would hold Redis (and every worker's command behind it) for its whole
        length, and redis-py's packing of a SET a key costs the monitor's CPU; the script makes
        them one command per batch (docs/decisions.md, "Thousands of sources")."""
        sources = list(grants)
        for start in range(0, len(sources), REFILL_BATCH):
            batch = sources[start:start + REFILL_BATCH]
            due = [s for s in batch if rate_due(rates[s], self._rates_written.get(s), now)]
            await self._refill(
                keys=[contracts.tokens_key(s) for s in batch] + [contracts.rate_limit_key(s) for s in due],
                args=[BUCKET_TTL_MS, RATE_LIMIT_TTL_SECONDS, len(batch), *(grants[s] for s in batch),
                      *(rates[s] for s in due)])
            self._rates_written.update((s, (rates[s], now)) for s in due)

    def forget_written(self) -> None:
        """Redis lost its data: every rate_limit:{source} is written again at the next tick, so
        no bucket goes without the rate that paces it (``rate_due``), and the back-off's states at
        their next save."""
        self._rates_written = {}
        if self._adaptation is not None:
            self._adaptation.forget_written()

    async def empty_buckets(self) -> None:
        """On a clean stop, take every token back now rather than when the keys expire."""
        keys = [key for source in self.rates
                for key in (contracts.tokens_key(source), contracts.rate_limit_key(source))]
        if keys:
            await self._redis.delete(*keys)
        self._rates_written = {}

    def _take_tokens(self, source: str, rate: float) -> int:
        if rate <= 0:
            self._credit.pop(source, None)
            return 0
        # Each source starts at its own phase, so sources below 1 req/s don't all
        # get their token in the same second (a worker would idle every other one).
        credit = self._credit.get(source, zlib.crc32(source.encode()) / 2**32) + rate
        tokens = math.floor(credit + _EPSILON)
        self._credit[source] = max(0.0, credit - tokens)
        return tokens

    def _configured_rate(self, source: str, override: str | None) -> tuple[float | None, str]:
        """The source's limit and where it comes from (OVERRIDE, CATALOG, LIST or DEFAULT)."""
        rate, kind = self._number(contracts.override_rate_key(source), source, override), OVERRIDE
        if rate is None:
            rate, kind = self._computed.get(source), CATALOG
        if rate is None:
            rate, kind = (self._from_lists[source], LIST) if source in self._from_lists else (self._default_rate,
                                                                                                DEFAULT)
        if rate is not None:
            self._unknown_reported_at.pop(source, None)
        return rate, kind

    def _report_unknown(self, source: str, now: float) -> None:
        """Once, then again every few minutes while it lasts: a log line a second is noise."""
        last = self._unknown_reported_at.get(source)
        if last is None or now - last >= UNKNOWN_SOURCE_REPORT_SECONDS:
            self._unknown_reported_at[source] = now
            log_event(contracts.EVENT_SOURCE_UNKNOWN, source=source,
                      msg=f"{source} has URLs but is neither in the sources list nor in a URL list produced, "
                          f"nor overridden; it gets no tokens. Set {contracts.override_rate_key(source)} "
                          f"(or DEFAULT_SOURCE_RATE) to crawl it.")

    def _paused(self, source: str, retry_after: str | None, now: float) -> bool:
        """Whether a worker's Retry-After (a Unix time) still pauses the source."""
        if retry_after is None:
            self._pauses.pop(source, None)
            return False
        known = self._pauses.get(source)
        if known is None or known[0] != retry_after:
            until = self._number(contracts.retry_after_key(source), source, retry_after)
            if until is None:
                return False
            # Capped when first seen, so a far-future value cannot stop a source for good.
            until = min(until, now + MAX_RETRY_AFTER_SECONDS)
            was_paused = known is not None and known[1] > now
            self._pauses[source] = (retry_after, until)
            if until > now and not was_paused:
                log_event(contracts.EVENT_RETRY_AFTER, source=source,
                          until=datetime.fromtimestamp(until, UTC).isoformat())
        return self._pauses[source][1] > now

    def _number(self, key: str, source: str, raw: str | None) -> float | None:
        """A non-negative finite float from an operator- or worker-written key; else report once."""
        if raw is None:
            self._reported_bad.pop(key, None)
            return None
        value = non_negative(raw)
        if value is not None:
            self._reported_bad.pop(key, None)
            return value
        if self._reported_bad.get(key) != raw:
            self._reported_bad[key] = raw
            log_event(contracts.EVENT_REDIS_VALUE_IGNORED, source=source, key=key, value=str(raw)[:100],
                      msg="not a non-negative number: ignored")
        return None
