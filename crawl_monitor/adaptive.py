"""Adaptive back-off: a source's rate follows how fast its site answers (AIMD).

A site can answer every request correctly and still be overwhelmed: it queues them, and
every other visitor waits too. Workers record each response's time to first byte
(``common.response_times``); here the monitor keeps, per source,

- a **baseline**: the lowest median seen, i.e. the site's time when lightly loaded. It
  drifts up (doubling in ``ADAPTIVE_BASELINE_DOUBLING_SECONDS``) unless a faster median
  resets it, so a site that really got slower is re-baselined within minutes;
- the **recent** median: the newest buckets merged until ``ADAPTIVE_MIN_SAMPLES``
  responses (one 2-second bucket for a busy source, several for a slow one);

and a multiplier on the source's rate limit (the computed or overridden rate, the
*ceiling*). When the recent median passes twice the baseline (and by 100 ms: loopback
noise is not load), or timeouts and 429/502/503/504 pass 5% of the answers, the
multiplier drops x0.7; when the median is back within 1.5x the baseline it climbs by
a step (the larger of 1 req/s and 2% of the ceiling). Never above the ceiling, never
below ``ADAPTIVE_FLOOR_RPS``. Each change is judged again only on responses to requests
made after it (buckets that started once its first answers could come: the site's time and
the worker's lag after it), so one slow queue is not punished twice.

A source new to the monitor starts at a tenth of its ceiling (a site saturated from the
first second would otherwise teach a saturated baseline) and doubles while answers stay
fast (TCP's slow start). Complete buckets of 10 answers would be ~10 s per doubling at a
few req/s, so the slow start is judged every second on the answers
recorded since the last look (``observe_fresh``): a few (``ADAPTIVE_SLOW_START_SAMPLES``),
to requests made after the last doubling, tell "as fast as at first" from "slower". The
first slow-down ends the slow start: overload answers at once, halving the multiplier (back to
the last rate answered fast); a slow median once the next fresh answers are slow too
(``slow_start_move``), landing near what the site served over both slow looks, its capacity,
once the queue our requests built there (what waited for its slowest answers, and what was sent
past its capacity while they came) has drained at half of it (``landing``), or as soon as answers
to requests sent since come at the site's unloaded speed (``observe_drain``). Capacity discovery is
the same controller with a higher top: a source the regulator lets discover starts at a fifth
of its ``cap`` and climbs past its limit (multiplier above 1) up to it; past the limit a
doubling needs more fresh answers, to requests sent over a look (about a second) at the current
grant (``doubling_evidence``), so a site whose queue builds is heard before the next doubling and
loopback noise is not load, and it grows to at most twice the rate the site answered
(docs/decisions.md, "Capacity discovery"). The state is kept in ``adaptive:{source}``, so a
monitor that takes over continues where the last one was; ``adaptive_off:{source}`` switches a
source back to its ceiling.

``Controller`` is the decision, pure; ``Adaptation`` reads and writes Redis around it. The
regulator asks ``Adaptation.effective`` for each source it grants a rate; the monitor runs
``Adaptation.update`` just before each of the regulator's ticks, so a verdict is granted at once.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from common import contracts
from common.protocols import AsyncRedis
from common.redis_values import as_text, finite_number
from common.response_times import RESPONSE_BUCKET_SECONDS, bucket_start, median_ms, parse_bucket, quantile_ms
from crawl_monitor.active_sources import active_since_each
from crawl_monitor.batched_keys import BatchedKeys
from crawl_monitor.recency import Recency
from crawl_monitor.constants import (ACTIVE_SOURCES_SLACK_SECONDS, ADAPTIVE_ANSWER_LAG_SECONDS, ADAPTIVE_ASKED_SECONDS,
                                     ADAPTIVE_FORGET_SECONDS,
                                     ADAPTIVE_BASELINE_DOUBLING_SECONDS, ADAPTIVE_DECREASE,
                                     ADAPTIVE_DISCOVERY_START_SHARE,
                                     ADAPTIVE_DISCOVERY_SAMPLES, ADAPTIVE_DISCOVERY_SECONDS, ADAPTIVE_DRAIN_MAX_SECONDS,
                                     ADAPTIVE_DRAIN_QUANTILE, ADAPTIVE_DRAIN_SHARE, ADAPTIVE_DRAINED_FACTOR,
                                     ADAPTIVE_DRAINED_MIN_EXTRA_MS,
                                     ADAPTIVE_FLOOR_RPS, ADAPTIVE_LAND_SHARE,
                                     ADAPTIVE_MIN_SAMPLES, ADAPTIVE_OVERLOAD_MIN, ADAPTIVE_OVERLOAD_SHARE,
                                     ADAPTIVE_READ_GRACE_SECONDS, ADAPTIVE_READINGS_KEPT,
                                     ADAPTIVE_RECOVERED_FACTOR, ADAPTIVE_RECOVERED_MIN_EXTRA_MS,
                                     ADAPTIVE_SLOW_FACTOR, ADAPTIVE_SLOW_MIN_EXTRA_MS, ADAPTIVE_SLOW_START_SAMPLES,
                                     ADAPTIVE_START_SHARE, ADAPTIVE_STATE_RENEW_SECONDS, ADAPTIVE_STATE_TTL_SECONDS,
                                     ADAPTIVE_STEP_RPS, ADAPTIVE_STEP_SHARE)

DOWN, UP, HOLD, WAIT, OFF = "down", "up", "hold", "wait", "off"


@dataclass(frozen=True)
class Reading:
    """Answers of one source: counts by latency bin, and overload answers. ``start`` is the
    start of their 2-second bucket (Unix s) or, for answers counted as they are recorded
    (the slow start's), of the span since the last look."""
    start: float
    bins: dict[int, int]
    overload: int = 0

    @property
    def total(self) -> int:
        return sum(self.bins.values()) + self.overload


def _merged(readings: Iterable[Reading], enough: int = ADAPTIVE_MIN_SAMPLES) -> tuple[dict[int, int], int, int]:
    """The newest readings merged until they hold ``enough`` answers."""
    bins: dict[int, int] = {}
    overload = total = 0
    for reading in readings:
        for index, n in reading.bins.items():
            bins[index] = bins.get(index, 0) + n
        overload += reading.overload
        total += reading.total
        if total >= enough:
            break
    return bins, overload, total


def answers_since(now: tuple[dict[int, int], int], before: tuple[dict[int, int], int] | None
                  ) -> tuple[dict[int, int], int]:
    """A bucket's answers recorded between two reads of it (its counts only grow)."""
    bins, overload = now
    if before is None:
        return bins, overload
    old_bins, old_overload = before
    fresh = {index: n - old_bins.get(index, 0) for index, n in bins.items() if n > old_bins.get(index, 0)}
    return fresh, max(0, overload - old_overload)


def floor_share(ceiling: float) -> float:
    """The lowest multiplier: ADAPTIVE_FLOOR_RPS of the ceiling (1 when the ceiling is lower)."""
    return 1.0 if ceiling <= ADAPTIVE_FLOOR_RPS else ADAPTIVE_FLOOR_RPS / ceiling


def top_share(limit: float, cap: float | None) -> float:
    """The highest multiplier: ``cap`` (capacity discovery's ceiling) over the limit, at least 1."""
    if cap is None or not limit > 0:
        return 1.0
    return max(1.0, cap / limit)


def start_share(limit: float, cap: float | None) -> float:
    """Where a slow start begins: a tenth of the limit; a fifth of discovery's ceiling above it
    (docs/decisions.md, "Capacity discovery": an overrun there drains and lands within seconds)."""
    top = top_share(limit, cap)
    return top * (ADAPTIVE_DISCOVERY_START_SHARE if top > 1 else ADAPTIVE_START_SHARE)


def doubling_evidence(level: float) -> tuple[int, float]:
    """(fresh answers, seconds at the current grant) a slow-start doubling from ``level`` (a
    share of the limit) needs: a few below the limit; past it, where only the site's answers
    vouch for the rate, more answers, over a look (about a second), so a site whose queue builds
    at the new rate is heard before the next doubling."""
    if level < 1.0:
        return ADAPTIVE_SLOW_START_SAMPLES, 0.0
    return ADAPTIVE_DISCOVERY_SAMPLES, ADAPTIVE_DISCOVERY_SECONDS


def answered_rate(readings: Iterable[Reading], now: float, seconds: float) -> float:
    """Answers a second over the newest readings (newest first) that cover ``seconds`` up to ``now``."""
    total, start = 0, now
    for reading in readings:
        total += reading.total
        start = reading.start
        if now - start >= seconds:
            break
    return total / (now - start) if now > start else 0.0


def landing(level: float, served: float, slow_ms: float, baseline_ms: float, lowest: float
            ) -> tuple[float, float, float]:
    """Where a slow start that overran its site goes: (a level to drain at, for how many seconds,
    the level after). ``served``: the site's answers a second while it was slow, as a share of the
    limit (what it can take); ``slow_ms`` over ``baseline_ms``: the queue our requests built there.
    The queue holds what waited when the slow answers' requests came (their delay at ``served``)
    and what was sent past ``served`` since, at ``level``, over the ``slow_ms`` their answers took
    to tell; at ADAPTIVE_DRAIN_SHARE of what the site serves it drains at the rest of its rate
    (for at most ADAPTIVE_DRAIN_MAX_SECONDS; not at all if the floor is what the site serves); then
    ADAPTIVE_LAND_SHARE of it, never above the level that overran it."""
    drain = max(lowest, min(level, ADAPTIVE_DRAIN_SHARE * served))
    queued = served * max(0.0, slow_ms - baseline_ms) / 1000 + max(0.0, level - served) * slow_ms / 1000
    seconds = min(ADAPTIVE_DRAIN_MAX_SECONDS, queued / (served - drain)) if served > drain else 0.0
    after = max(lowest, min(level, ADAPTIVE_LAND_SHARE * served))
    return drain, seconds, after


SLOW, FAST = "slow", "fast"


def slow_start_move(verdict: str | None, overloaded: bool, slow_before: bool) -> str:
    """The slow start's move on one judgement of fresh answers: DOWN (end it) on overload answers
    or on a slow median confirmed by the next fresh answers; HOLD on a first slow median (a
    worker's late event loop delays one look's answers, a site's queue slows the next too) or
    an undecided one; UP (may double) when fast."""
    if verdict == SLOW:
        return DOWN if overloaded or slow_before else HOLD
    return UP if verdict == FAST else HOLD


def past(median: float, baseline: float, factor: float, extra_ms: float) -> bool:
    """A median (ms) above ``factor`` x the baseline and ``extra_ms`` above it, whichever is more."""
    return median > max(factor * baseline, baseline + extra_ms)


def overloaded(overload: int, total: int) -> bool:
    """Timeouts and 429/502/503/504 past ADAPTIVE_OVERLOAD_SHARE of the answers (at least ADAPTIVE_OVERLOAD_MIN)."""
    return overload >= ADAPTIVE_OVERLOAD_MIN and overload > ADAPTIVE_OVERLOAD_SHARE * total


def to_write(fields: dict[str, str], held: dict[str, str] | None, held_for: float) -> dict[str, str] | None:
    """What a save of ``fields`` (``Controller.saved``; an empty value deletes its field) writes to a
    hash known to hold ``held`` (None: not known) since ``held_for`` seconds: nothing (None) when it
    holds them already and its expiry was renewed within ADAPTIVE_STATE_RENEW_SECONDS; else every
    field but the deletions of fields it does not hold."""
    if held is None:
        return fields
    if fields == held and held_for < ADAPTIVE_STATE_RENEW_SECONDS:
        return None
    return {name: value for name, value in fields.items() if value or held.get(name)}


@dataclass
class Controller:
    """One source's AIMD state. ``observe`` each completed bucket, in order, and during the
    slow start ``observe_fresh`` the answers recorded since the last look, every second.

    The multiplier is of the source's limit (``ceiling`` in the methods: its override or size's
    rate); ``cap``, when above it, lets the multiplier climb past 1 to cap / limit (capacity
    discovery): the same slow start and AIMD, with a higher top."""
    multiplier: float = ADAPTIVE_START_SHARE
    slow_start: bool = True           # doubling until the first slow-down
    slow_seen: Reading | None = None  # the answers of the slow start's last look, if slow and unconfirmed
    baseline_ms: float | None = None  # as set at baseline_at; ``baseline(now)`` adds the drift
    baseline_at: float = 0.0
    recent_ms: float | None = None
    changed_at: float = float("-inf")  # buckets that started before this are not judged again
    readings: deque[Reading] = field(default_factory=lambda: deque(maxlen=ADAPTIVE_READINGS_KEPT))
    fresh: deque[Reading] = field(default_factory=lambda: deque(maxlen=ADAPTIVE_READINGS_KEPT))  # since the change
    drain_until: float | None = None  # draining the queue an overrun built (``landing``) until then...
    landing_multiplier: float = 0.0   # ... then this

    def rate(self, ceiling: float, cap: float | None = None) -> float:
        return ceiling * self.level(ceiling, cap)

    def level(self, ceiling: float, cap: float | None = None) -> float:
        """The share of the limit granted now: the multiplier between the floor and the top, and
        during the slow start at least its beginning (``start_share``)."""
        start = start_share(ceiling, cap) if self.slow_start else 0.0
        return min(top_share(ceiling, cap), max(self.multiplier, floor_share(ceiling), start))

    def baseline(self, now: float) -> float | None:
        if self.baseline_ms is None:
            return None
        return self.baseline_ms * 2 ** (max(0.0, now - self.baseline_at) / ADAPTIVE_BASELINE_DOUBLING_SECONDS)

    def observe(self, reading: Reading, ceiling: float, now: float, enabled: bool = True,
                cap: float | None = None) -> str:
        """Take one bucket's answers; change the multiplier if they call for it. Returns the verdict."""
        # Only buckets that had answers are observed, so the window is kept by time, not count.
        window = ADAPTIVE_READINGS_KEPT * RESPONSE_BUCKET_SECONDS
        while self.readings and self.readings[0].start <= reading.start - window:
            self.readings.popleft()
        self.readings.append(reading)
        newest = list(reversed(self.readings))
        bins, _, total = _merged(newest)
        if total >= ADAPTIVE_MIN_SAMPLES:
            self.recent_ms = median_ms(bins)
            baseline = self.baseline(now)
            if self.recent_ms is not None and (baseline is None or self.recent_ms < baseline):
                self.baseline_ms, self.baseline_at = self.recent_ms, now
        if not enabled:
            self.switch_off()
            return OFF
        self.land(now)
        if self.drain_until is not None:
            return HOLD
        lowest, top = floor_share(ceiling), top_share(ceiling, cap)
        if self.slow_start:
            if lowest < top:
                return WAIT  # judged each second on the answers as they come (``observe_fresh``)
            self.multiplier, self.slow_start = top, False  # at most the floor: nothing to start
        bins, overload, total = _merged(r for r in newest if r.start >= self._settled(now))
        if total < ADAPTIVE_MIN_SAMPLES:
            return WAIT
        baseline = self.baseline(now)
        verdict = self._judge(bins, overload, total, baseline)
        if verdict == SLOW:
            self.multiplier = max(lowest, min(top, self.multiplier) * ADAPTIVE_DECREASE)
            self._changed(now)
            return DOWN
        if verdict == FAST and self.multiplier < top:
            step = max(ADAPTIVE_STEP_RPS, ADAPTIVE_STEP_SHARE * ceiling * top) / ceiling
            self.multiplier = min(top, self.multiplier + step)
            self._changed(now)
            return UP
        return WAIT if baseline is None else HOLD

    def observe_fresh(self, reading: Reading, ceiling: float, now: float, cap: float | None = None) -> str:
        """The slow start: answers recorded from ``reading.start`` to ``now``. Double once
        enough answers to requests made after the last change (``doubling_evidence``) are as
        fast as at first; at the first slow-down end the slow start: halve on overload answers,
        drain and land (``landing``) on a slow median."""
        if not self.slow_start:
            return WAIT
        level = self.level(ceiling, cap)
        samples, seconds = doubling_evidence(level)
        settled = self._settled(now)  # most of the span must come after it
        if (reading.start + now) / 2 < settled:
            return WAIT
        self.fresh.append(reading)
        bins, overload, total = _merged(reversed(self.fresh), samples)
        if total < samples:
            return WAIT
        median, baseline = median_ms(bins), self.baseline(now)
        if median is not None and (baseline is None or median < baseline):
            self.baseline_ms, self.baseline_at = median, now
        verdict = self._judge(bins, overload, total, self.baseline(now))
        overran = overloaded(overload, total)
        move = slow_start_move(verdict, overran, self.slow_seen is not None)
        lowest, top = floor_share(ceiling), top_share(ceiling, cap)
        if move == DOWN:
            first_slow, self.slow_start, self.slow_seen = self.slow_seen, False, None
            baseline = self.baseline(now)
            if overran or median is None or baseline is None:  # refusals: one doubling back, by steps from there
                self.multiplier = max(lowest, level / 2)
            else:  # slow: its queue drained, then near what it served (its capacity)
                assert first_slow is not None  # a slow median ends it only on the second slow look
                served = answered_rate(reversed([first_slow, *self.fresh]), now, float("inf")) / ceiling
                queued_ms = quantile_ms(bins, ADAPTIVE_DRAIN_QUANTILE) or median
                self.multiplier, seconds, self.landing_multiplier = landing(level, served, queued_ms, baseline, lowest)
                self.drain_until = now + seconds
            self._changed(now)
            return DOWN
        if verdict == SLOW:  # to be confirmed by answers not yet judged
            self.slow_seen = self.fresh[-1]
            self.fresh.clear()
            return HOLD
        if verdict == FAST:
            self.slow_seen = None
        if move == UP and now - max(settled, self.fresh[0].start) >= seconds:
            grown = min(top, level * 2)
            if seconds:  # past the limit: at most twice the rate the site answered (its proof)
                grown = min(grown, max(level, 2 * answered_rate(reversed(self.fresh), now, seconds) / ceiling))
            if grown <= level:
                return HOLD
            self.multiplier = grown
            self.slow_start = self.multiplier < top
            self._changed(now)
            return UP
        return HOLD

    @staticmethod
    def _judge(bins: dict[int, int], overload: int, total: int, baseline: float | None) -> str | None:
        """SLOW (past 2x the baseline and +100 ms, or overload answers past 5%), FAST (within
        1.5x or +50 ms), or None: in between, or no baseline to judge by."""
        if overloaded(overload, total):
            return SLOW
        median = median_ms(bins)
        if median is None or baseline is None:
            return None
        if past(median, baseline, ADAPTIVE_SLOW_FACTOR, ADAPTIVE_SLOW_MIN_EXTRA_MS):
            return SLOW
        if not past(median, baseline, ADAPTIVE_RECOVERED_FACTOR, ADAPTIVE_RECOVERED_MIN_EXTRA_MS):
            return FAST
        return None

    def _settled(self, now: float) -> float:
        """When answers to requests made under the last change began: it, plus the site's time and
        the worker's lag in recording them."""
        return self.changed_at + ADAPTIVE_ANSWER_LAG_SECONDS + (self.baseline(now) or 0.0) / 1000

    def land(self, now: float) -> bool:
        """Past an overrun's drain (``landing``), take the level after it, judged afresh; True if it did."""
        if self.drain_until is None or now < self.drain_until:
            return False
        self.multiplier, self.drain_until = self.landing_multiplier, None
        self._changed(now)
        return True

    def observe_drain(self, reading: Reading, now: float) -> str:
        """While an overrun's queue drains (``landing``): answers recorded from ``reading.start`` to
        ``now``. Land at once when ADAPTIVE_SLOW_START_SAMPLES answers to requests made during the
        drain come at the site's unloaded speed: nothing waited ahead of them, so the queue is gone.
        The drain's length is an upper bound: the workers' per-host cap may have held back much of
        what the grant allowed past the site's capacity."""
        if self.drain_until is None or (reading.start + now) / 2 < self._settled(now):
            return WAIT
        self.fresh.append(reading)
        bins, overload, total = _merged(reversed(self.fresh), ADAPTIVE_SLOW_START_SAMPLES)
        median, baseline = median_ms(bins), self.baseline(now)
        if total < ADAPTIVE_SLOW_START_SAMPLES or overloaded(overload, total) or median is None or baseline is None \
                or past(median, baseline, ADAPTIVE_DRAINED_FACTOR, ADAPTIVE_DRAINED_MIN_EXTRA_MS):
            return HOLD
        self.drain_until = now
        self.land(now)
        return UP

    def _changed(self, now: float) -> None:
        """A new multiplier: only answers to requests made under it judge it."""
        self.changed_at = now
        self.fresh.clear()

    def switch_off(self) -> None:
        """``adaptive_off:{source}``: the whole ceiling, and no slow start once switched back on."""
        self.multiplier, self.slow_start, self.drain_until = 1.0, False, None

    # --- kept in Redis (adaptive:{source}), so another monitor continues from here
    def state(self, ceiling: float, enabled: bool, cap: float | None = None) -> tuple:
        """What ``saved`` is made of, unformatted: equal states save equal fields."""
        return (ceiling, enabled, cap, self.multiplier, self.slow_start, self.baseline_ms, self.baseline_at,
                self.recent_ms, self.changed_at, self.drain_until, self.landing_multiplier)

    def saved(self, ceiling: float, enabled: bool, cap: float | None = None) -> dict[str, str]:
        top = ceiling * top_share(ceiling, cap) if enabled else ceiling
        fields = {"effective_rate": self.rate(ceiling, cap) if enabled else ceiling,
                  contracts.ADAPTIVE_LIMIT_FIELD: ceiling, contracts.ADAPTIVE_CEILING_FIELD: top,
                  "multiplier": self.multiplier, contracts.ADAPTIVE_SLOW_START_FIELD: int(self.slow_start),
                  "enabled": int(enabled),
                  "baseline_ms": self.baseline_ms, "baseline_at": self.baseline_at,
                  "recent_ms": self.recent_ms,
                  "changed_at": self.changed_at if self.changed_at > float("-inf") else None,
                  "drain_until": self.drain_until,
                  "landing_multiplier": self.landing_multiplier if self.drain_until is not None else None}
        gone = ("drain_until", "landing_multiplier")  # dropped once landed: a monitor taking over must not land again
        return {name: "" if value is None else f"{value:.15g}" if isinstance(value, float) else str(value)
                for name, value in fields.items() if value is not None or name in gone}

    @classmethod
    def restored(cls, raw: dict) -> Controller:
        """From ``saved``'s fields; values that are missing or not numbers start afresh."""
        values = {as_text(k): finite_number(v) for k, v in raw.items()}
        controller = cls()
        multiplier = values.get("multiplier")
        if multiplier is not None and multiplier > 0:
            controller.multiplier = multiplier
            controller.slow_start = values.get(contracts.ADAPTIVE_SLOW_START_FIELD) == 1
        baseline, baseline_at = values.get("baseline_ms"), values.get("baseline_at")
        if baseline is not None and baseline > 0 and baseline_at is not None:
            controller.baseline_ms, controller.baseline_at = baseline, baseline_at
        changed_at = values.get("changed_at")
        if changed_at is not None:  # the buckets already judged are not judged again
            controller.changed_at = changed_at
        drain_until, landing_multiplier = values.get("drain_until"), values.get("landing_multiplier")
        if drain_until is not None and landing_multiplier is not None and landing_multiplier > 0:
            controller.drain_until, controller.landing_multiplier = drain_until, landing_multiplier
        return controller


class Adaptation:
    """The monitor's side: reads each completed response bucket, decides, saves, and answers
    the regulator's ``effective(source, ceiling)`` from memory."""

    def __init__(self, redis: AsyncRedis, clock: Callable[[], float] = time.time):
        self._redis = redis
        self._keys = BatchedKeys(redis)
        self._clock = clock
        self.controllers: dict[str, Controller] = {}
        self._ceilings: dict[str, float] = {}
        self._caps: dict[str, float | None] = {}  # capacity discovery's ceiling, for the sources that may discover
        self.disabled: set[str] = set()
        self._next_bucket: int | None = None
        self._saved_as: dict[str, tuple[float, float | None, bool]] = {}  # (ceiling, cap, enabled) last saved
        # Source -> what its adaptive:{source} holds (as read or last written), when it was written, and
        # the state it was written from (``Controller.state``; None: read).
        self._held: dict[str, tuple[dict[str, str], float, tuple | None]] = {}
        self._asked = Recency()  # when the regulator last asked about each source (its clock)
        self._next_forget = 0.0
        # Slow-starting source -> (when last read, its open buckets' counts then), for the answers since.
        self._open_counts: dict[str, tuple[float, dict[int, tuple[dict[int, int], int]]]] = {}
        self._last_look = float("-inf")  # when the open buckets were last looked at

    def forget_written(self) -> None:
        """Redis lost its data: each source's adaptive:{source} is written whole at its next save."""
        self._held = {}

    async def meet(self, sources: Iterable[str]) -> None:
        """Read the saved state and switch of the sources not in memory, before their first grant.

        Met at their first ``effective`` instead, they would be granted a slow start's tenth
        until the next ``update``: after a monitor restart, a second at a tenth of every rate,
        and the workers that read it would park URLs by it."""
        new = [source for source in sources if source not in self.controllers]
        if not new:
            return
        switches = await self._redis.mget([contracts.adaptive_off_key(source) for source in new])
        saved = await self._keys.hashes([contracts.adaptive_key(source) for source in new])
        for source, switch, raw in zip(new, switches, saved, strict=True):
            self.controllers[source] = Controller.restored(raw) if raw else Controller()
            self._held[source] = ({as_text(k): as_text(v) for k, v in raw.items()}, float("-inf"), None)
            if switch is not None:
                self.disabled.add(source)

    def effective(self, source: str, ceiling: float, cap: float | None = None) -> float:
        """The rate to grant a source whose limit is ``ceiling`` (req/s) this second; one that may
        discover its capacity climbs up to ``cap`` while its answers stay fast."""
        self._ceilings[source] = ceiling
        self._caps[source] = cap
        self._asked.ask(source, self._clock())
        controller = self.controllers.get(source)
        if controller is None:  # not met (``meet``): a new source
            controller = self.controllers[source] = Controller()
        if source in self.disabled:
            return ceiling
        # A multiplier past the top now (discovery switched off, a lower cap) is not kept for later.
        controller.multiplier = min(controller.multiplier, top_share(ceiling, cap))
        return controller.rate(ceiling, cap)

    async def update(self) -> None:
        """Once a second: the switches, the buckets that ended,
        and the slow-starting and draining sources' open buckets (for the answers recorded since the last look).

        Only the sources the regulator granted a rate lately are considered (not every source
        ever seen), and of them only those with an outcome since the oldest due bucket
        began (``active_sources``) can have answers in it; only they are read, judged and saved,
        with any source whose ceiling or switch changed; a slow-starting or draining source's open
        buckets only while it has answers since the last look. A quiet source's state waits in
        memory, and in Redis; one not asked about for ADAPTIVE_FORGET_SECONDS is forgotten
        here and restored from Redis (``meet``) if it comes back.
        """
        now = self._clock()
        self._forget_unasked(now)
        sources = self._asked.since(now - ADAPTIVE_ASKED_SECONDS)
        if not sources:
            return
        last_complete = bucket_start(now - ADAPTIVE_READ_GRACE_SECONDS) - RESPONSE_BUCKET_SECONDS
        oldest_kept = last_complete - ADAPTIVE_READINGS_KEPT * RESPONSE_BUCKET_SECONDS
        if self._next_bucket is None or self._next_bucket < oldest_kept:  # new, or stalled for long
            self._next_bucket = last_complete
        due = list(range(self._next_bucket, last_complete + 1, RESPONSE_BUCKET_SECONDS))
        since_due = due[0] if due else now - RESPONSE_BUCKET_SECONDS
        since_look = self._last_look - ACTIVE_SOURCES_SLACK_SECONDS
        sinces = [since_due, since_look] if since_look > since_due else [since_due]
        recent, *answering = await active_since_each(self._redis, sinces)
        active = sorted(recent & set(sources))
        answered = active if due else []
        starting = [source for source in active if self._slow_starting(source)]
        draining = [source for source in active if self.controllers[source].drain_until is not None
                    and source not in self.disabled]
        looked = starting + draining  # judged on the answers recorded since the last look
        # Of those, only the sources with an answer since the last look (less the workers' slack) can
        # have new answers in their open buckets: a one-URL site is read twice, not at each look.
        reread = looked if not answering else [s for s in looked if s not in self._open_counts or s in answering[0]]
        self._last_look = now
        open_buckets = (bucket_start(now) - RESPONSE_BUCKET_SECONDS, bucket_start(now))
        switches = await self._redis.mget([contracts.adaptive_off_key(s) for s in sources])
        rest = await self._keys.hashes(
            [contracts.response_times_key(source, start) for start in due for source in answered]
            + [contracts.response_times_key(source, start) for source in reread for start in open_buckets])
        buckets, opened = rest[:len(due) * len(answered)], rest[len(due) * len(answered):]
        self.disabled = {s for s, value in zip(sources, switches, strict=True) if value is not None}
        for source in self.disabled:  # judged or not this second
            self.controllers[source].switch_off()
        if due:
            self._next_bucket = due[-1] + RESPONSE_BUCKET_SECONDS
        raw_buckets = iter(buckets)
        observed = set()
        for start in due:
            for source in answered:
                bins, overload = parse_bucket(next(raw_buckets) or {})
                if bins or overload:
                    observed.add(source)
                    self.controllers[source].observe(Reading(start, bins, overload), self._ceilings[source], now,
                                                     enabled=source not in self.disabled, cap=self._caps[source])
        observed.update(source for source in sources if self.controllers[source].land(now))
        raw_open = iter(opened)
        fresh = {source: self._since_last_look(source, {start: next(raw_open) for start in open_buckets}, now)
                 for source in reread}
        # A source out of the window for a second keeps its counts while their buckets are open:
        # back in it, the answers already judged are not counted again.
        self._open_counts = {source: (at, counts) for source, (at, counts) in self._open_counts.items()
                             if source in looked or max(counts, default=0) >= open_buckets[0]}
        for source in looked:
            if source not in fresh:  # looked at now, as a read finding nothing new leaves them
                counts = self._open_counts[source][1]
                self._open_counts[source] = (now, {start: counts.get(start, ({}, 0)) for start in open_buckets})
        for source, reading in fresh.items():
            if not reading.total or source in self.disabled:  # switched off meanwhile
                continue
            controller = self.controllers[source]
            if self._slow_starting(source):  # not if restored meanwhile
                observed.add(source)
                controller.observe_fresh(reading, self._ceilings[source], now, self._caps[source])
            elif controller.observe_drain(reading, now) == UP:
                observed.add(source)
        await self._save(observed, sources)

    def _forget_unasked(self, now: float) -> None:
        if now < self._next_forget:
            return
        self._next_forget = now + ADAPTIVE_ASKED_SECONDS
        for source in self._asked.older_than(now - ADAPTIVE_FORGET_SECONDS):
            for kept in (self.controllers, self._ceilings, self._caps, self._saved_as, self._held):
                kept.pop(source, None)
            self.disabled.discard(source)

    def _since_last_look(self, source: str, raw_buckets: dict[int, dict], now: float) -> Reading:
        """The answers recorded in a source's open buckets since they were last read (all of
        them, from the older bucket's start, at the first look)."""
        looked_at, before = self._open_counts.get(source, (min(raw_buckets), {}))
        counts = {start: parse_bucket(raw or {}) for start, raw in raw_buckets.items()}
        self._open_counts[source] = (now, counts)
        bins: dict[int, int] = {}
        overload = 0
        for start, counted in counts.items():
            new_bins, new_overload = answers_since(counted, before.get(start))
            for index, n in new_bins.items():
                bins[index] = bins.get(index, 0) + n
            overload += new_overload
        return Reading(looked_at, bins, overload)

    def _slow_starting(self, source: str) -> bool:
        """In slow start below its ceiling: judged on its answers every second."""
        ceiling = self._ceilings[source]
        return (self.controllers[source].slow_start and source not in self.disabled
                and floor_share(ceiling) < top_share(ceiling, self._caps[source]))

    async def _save(self, observed: set[str], sources: list[str]) -> None:
        """``adaptive:{source}`` of the sources just judged and of those whose ceiling or switch
        changed; a judged source's expiry is renewed (at most every ADAPTIVE_STATE_RENEW_SECONDS
        while its state is unchanged: ``to_write``), so a quiet hour ends its state."""
        now = self._clock()
        writes: dict[str, tuple[dict[str, str], dict[str, str], tuple]] = {}  # source -> (fields, written, state)
        for source in sources:
            seen_as = (self._ceilings[source], self._caps[source], source not in self.disabled)
            if source in observed or self._saved_as.get(source) != seen_as:
                self._saved_as[source] = seen_as
                controller = self.controllers[source]
                ceiling, cap, enabled = seen_as
                state = controller.state(ceiling, enabled, cap)
                held, written_at, held_state = self._held.get(source, (None, float("-inf"), None))
                if state == held_state and now - written_at < ADAPTIVE_STATE_RENEW_SECONDS:
                    continue  # to_write's None, without formatting the fields
                fields = controller.saved(ceiling, enabled, cap)
                written = to_write(fields, held, now - written_at)
                if written is not None:
                    writes[source] = (fields, written, state)
        if writes:
            await self._keys.save_hashes({contracts.adaptive_key(source): written
                                          for source, (_, written, _) in writes.items()}, ADAPTIVE_STATE_TTL_SECONDS)
            self._held.update((source, (fields, now, state)) for source, (fields, _, state) in writes.items())
