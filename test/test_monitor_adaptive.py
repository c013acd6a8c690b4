"""The adaptive back-off's decisions (crawl_monitor.adaptive), with fakes and a model site."""
from __future__ import annotations

import statistics

import pytest

from common import contracts
from common.response_times import (OVERLOAD_FIELD, RESPONSE_BUCKET_SECONDS, bin_of, bucket_start, median_ms,
                                   parse_bucket, quantile_ms)
from crawl_monitor import adaptive
from crawl_monitor.adaptive import (DOWN, HOLD, OFF, UP, WAIT, Adaptation, Controller, Reading, doubling_evidence,
                                    landing, slow_start_move, start_share, to_write)
from crawl_monitor.constants import (ADAPTIVE_FLOOR_RPS, ADAPTIVE_READINGS_KEPT, ADAPTIVE_START_SHARE,
                                     ADAPTIVE_STATE_RENEW_SECONDS)
from crawl_monitor.regulator import Regulator
from test.test_monitor_fakes import FakeAsyncRedis, RecordingStore

T0 = 1_000_000.0


def reading(start: float, ms: float, n: int = 20, overload: int = 0) -> Reading:
    return Reading(int(start), {bin_of(ms / 1000): n} if n else {}, overload)


def binned(samples: list[float]) -> dict[int, int]:
    """Times to first byte (s) counted in their bins, as a worker records them."""
    bins: dict[int, int] = {}
    for s in samples:
        bins[bin_of(s)] = bins.get(bin_of(s), 0) + 1
    return bins


def test_bins_give_the_median_within_a_bin_and_ignore_junk() -> None:
    samples = [0.05 * (1 + i % 7) for i in range(101)]
    bins = binned(samples)
    assert median_ms(bins) == pytest.approx(statistics.median(samples) * 1000, rel=0.2)
    assert bin_of(0) == 0 == bin_of(float("nan")) and bin_of(10_000) == 68  # clamped both ways
    assert parse_bucket({"12": "3", "x": "9", "13": "-1", "14": "abc", OVERLOAD_FIELD: "2", "999": "1"}) == ({12: 3}, 2)
    assert median_ms({}) is None


@pytest.mark.parametrize("share", [0.1, 0.5, 0.75, 0.9])
def test_bins_give_any_quantile_within_a_bin(share: float) -> None:
    samples = sorted(0.05 * (1 + i % 7) + 0.001 * i for i in range(101))
    assert quantile_ms(binned(samples), share) == pytest.approx(samples[round(share * 100)] * 1000, rel=0.2)
    assert quantile_ms({}, share) is None


def fresh(since: float, ms: float, n: int = 3, overload: int = 0) -> Reading:
    """The answers recorded from ``since`` to the next look (a second later)."""
    return Reading(since, {bin_of(ms / 1000): n} if n else {}, overload)


def test_slow_start_doubles_each_second_from_a_tenth_while_answers_stay_fast() -> None:
    c = Controller()
    assert c.rate(40) == 4.0
    assert c.observe_fresh(fresh(T0, 30, n=2), 40, T0 + 1) == WAIT  # two answers are not yet a few
    verdicts = [c.observe_fresh(fresh(T0 + i, 30), 40, T0 + i + 1) for i in range(1, 6)]
    assert verdicts == [UP, UP, UP, UP, WAIT]  # 8, 16, 32, 40 req/s: a second each
    assert c.multiplier == 1.0 and not c.slow_start and c.rate(40) == 40
    assert c.baseline_ms == pytest.approx(30, rel=0.2)


def test_slow_start_waits_for_answers_to_requests_made_after_the_change() -> None:
    """A site answering in 0.6 s: the second after a doubling still brings the answers to
    requests sent before it, so the doubling after waits a second longer."""
    c = Controller()
    assert c.observe_fresh(fresh(T0, 600), 40, T0 + 1) == UP
    assert c.observe_fresh(fresh(T0 + 1, 600), 40, T0 + 2) == WAIT
    assert c.observe_fresh(fresh(T0 + 2, 600), 40, T0 + 3) == UP
    assert c.rate(40) == pytest.approx(16)


def test_a_slow_down_in_the_slow_start_halves_the_rate_and_ends_it() -> None:
    c = Controller()
    for i in range(2):
        assert c.observe_fresh(fresh(T0 + i, 200), 40, T0 + i + 1) == UP
    assert c.rate(40) == pytest.approx(16)
    assert c.observe_fresh(fresh(T0 + 2, 350), 40, T0 + 3) == HOLD   # between 1.5x and 2x: stay
    assert c.observe_fresh(fresh(T0 + 3, 200, n=2, overload=2), 40, T0 + 4) == DOWN  # 2 timeouts of 4
    assert c.rate(40) == pytest.approx(8) and not c.slow_start  # the last rate answered fast
    # From here complete buckets judge it, by steps; answers as they come no longer do.
    assert c.observe_fresh(fresh(T0 + 4, 200), 40, T0 + 5) == WAIT
    # ... those that began after the change had answers (its first answer the site's time and
    # the worker's lag after it): a bucket begun with it holds answers to requests made before.
    assert c.observe(reading(T0 + 4, 200), 40, T0 + 7) == WAIT and c.rate(40) == pytest.approx(8)
    assert c.observe(reading(T0 + 6, 200), 40, T0 + 9) == UP and c.rate(40) == pytest.approx(9)


def test_complete_buckets_leave_the_slow_start_to_the_answers_as_they_come() -> None:
    c = Controller()
    assert c.observe(reading(T0, 200), 40, T0 + 3) == WAIT and c.rate(40) == 4
    assert c.baseline_ms == pytest.approx(200, rel=0.1)  # but they teach the baseline
    # A source whose floor is its whole limit has nothing to start: buckets judge it at once.
    low = Controller()
    assert low.observe(reading(T0, 200), 1, T0 + 3) == HOLD and low.rate(1) == 1 and not low.slow_start


def test_the_slow_start_reaches_any_limit_within_seconds() -> None:
    """Issue 28: a site answering as fast as at first gets its whole limit within 10 s of its
    first request at any limit from 1 to 200 req/s. Modelled: requests evenly at the granted
    rate, answered in 30 ms and recorded 0.1 s later, the monitor looking once a second."""
    took = {}
    for limit in (1, 2, 3, 5, 7.5, 10, 12, 15, 20, 40, 60, 120.4, 200):
        c, t, sent, answers, looked = Controller(), T0, T0, [], T0
        while c.rate(limit) < limit and t < T0 + 30:
            t += 0.01
            while sent + 1 / c.rate(limit) <= t:
                sent += 1 / c.rate(limit)
                answers.append(sent + 0.13)
            if t >= looked + 1:
                n = sum(looked < at <= t for at in answers)
                if n:
                    c.observe_fresh(fresh(looked, 30, n=n), limit, t)
                looked = t
        took[limit] = t - T0
    assert max(took.values()) <= 9, took


def test_a_doubled_median_cuts_the_rate_then_it_climbs_back_by_steps() -> None:
    c = Controller(multiplier=1.0, slow_start=False)
    c.observe(reading(T0, 200), 40, T0 + 3)
    assert c.baseline(T0 + 3) == pytest.approx(200, rel=0.1)
    assert c.observe(reading(T0 + 2, 390), 40, T0 + 5) == HOLD      # under 2x: not yet
    assert c.observe(reading(T0 + 4, 700), 40, T0 + 7) == DOWN
    assert c.rate(40) == pytest.approx(28)
    assert c.observe(reading(T0 + 6, 900), 40, T0 + 9) == WAIT      # started before the cut
    assert c.observe(reading(T0 + 8, 900), 40, T0 + 11) == DOWN
    assert c.rate(40) == pytest.approx(19.6)
    c.observe(reading(T0 + 10, 200), 40, T0 + 13)
    assert c.observe(reading(T0 + 12, 210), 40, T0 + 15) == UP      # +1 req/s (2% of 40 is less)
    assert c.rate(40) == pytest.approx(20.6)
    assert c.observe(reading(T0 + 14, 210), 40, T0 + 17) == WAIT
    assert c.observe(reading(T0 + 16, 340), 40, T0 + 19) == HOLD    # between 1.5x and 2x: stay
    # The step is 2% of a large limit.
    big = Controller(multiplier=0.5, slow_start=False, baseline_ms=100, baseline_at=T0)
    assert big.observe(reading(T0, 100), 500, T0 + 3) == UP and big.rate(500) == pytest.approx(260)


def test_loopback_noise_is_not_load_and_overload_answers_count() -> None:
    c = Controller(multiplier=1.0, slow_start=False, baseline_ms=2.0, baseline_at=T0)
    assert c.observe(reading(T0, 60), 40, T0 + 3) == HOLD           # 30x a 2 ms baseline, but +58 ms
    assert c.observe(reading(T0 + 2, 150), 40, T0 + 5) == DOWN
    c = Controller(multiplier=1.0, slow_start=False, baseline_ms=200, baseline_at=T0)
    assert c.observe(reading(T0, 200, n=19, overload=1), 40, T0 + 3) == HOLD  # one is no trend
    assert c.observe(reading(T0 + 2, 200, n=18, overload=2), 40, T0 + 5) == DOWN
    # All timed out: no time to first byte at all, still a verdict.
    assert c.observe(reading(T0 + 6, 0, n=0, overload=12), 40, T0 + 9) == DOWN


def test_never_below_the_floor_nor_above_the_limit() -> None:
    c = Controller(multiplier=1.0, slow_start=False, baseline_ms=200, baseline_at=T0)
    for i in range(30):
        c.observe(reading(T0 + 2 * i, 2000), 40, T0 + 2 * i + 3)
    assert c.rate(40) == ADAPTIVE_FLOOR_RPS
    for i in range(30, 200):
        c.observe(reading(T0 + 2 * i, 200), 40, T0 + 2 * i + 3)
    assert c.rate(40) == 40
    assert Controller().rate(0.5) == 0.5 and Controller().rate(2) == ADAPTIVE_FLOOR_RPS  # a floor over a tenth


def test_a_site_that_got_slower_for_good_is_rebaselined_within_minutes() -> None:
    c = Controller(multiplier=1.0, slow_start=False)
    c.observe(reading(T0, 100), 40, T0 + 3)
    at = T0 + 5
    for i in range(400):
        at = T0 + 5 + 2 * i
        c.observe(reading(at - 3, 400), 40, at)
    assert c.baseline(at) == pytest.approx(400, rel=0.1)
    assert c.rate(40) == 40  # climbed back once 400 ms was the site's normal


def test_a_slow_source_merges_buckets_until_it_has_enough_answers() -> None:
    c = Controller(multiplier=0.5, slow_start=False, baseline_ms=200, baseline_at=T0)
    assert c.observe(reading(T0, 900, n=4), 10, T0 + 3) == WAIT
    assert c.observe(reading(T0 + 2, 900, n=4), 10, T0 + 5) == WAIT
    assert c.observe(reading(T0 + 4, 900, n=4), 10, T0 + 7) == DOWN


def test_switched_off_it_grants_the_limit_and_keeps_measuring() -> None:
    c = Controller(multiplier=0.3, slow_start=False, baseline_ms=200, baseline_at=T0)
    assert c.observe(reading(T0, 150), 40, T0 + 3, enabled=False) == OFF
    assert c.rate(40) == 40 and c.recent_ms == pytest.approx(150, rel=0.1)


def test_state_survives_a_monitor_restart_and_junk_starts_afresh() -> None:
    c = Controller(multiplier=0.42, slow_start=False, baseline_ms=210.0, baseline_at=T0, recent_ms=300.0)
    saved = c.saved(40, enabled=True)
    assert saved["effective_rate"] == "16.8" and saved["ceiling"] == "40"
    back = Controller.restored(saved)
    assert (back.multiplier, back.slow_start, back.baseline_ms, back.baseline_at) == (0.42, False, 210.0, T0)
    assert back.changed_at == float("-inf")  # never changed: every bucket counts
    now = 1_795_918_753.702  # Unix times come back to the millisecond, not 1.79592e+09
    back = Controller.restored(Controller(changed_at=now, baseline_ms=210.0, baseline_at=now).saved(40, enabled=True))
    assert back.changed_at == pytest.approx(now, abs=1e-3) and back.baseline_at == pytest.approx(now, abs=1e-3)
    fresh = Controller.restored({"multiplier": "nan", "baseline_ms": "-3", "baseline_at": "x"})
    assert (fresh.multiplier, fresh.slow_start, fresh.baseline_ms) == (Controller().multiplier, True, None)


def model_site(enabled: bool, seconds: float = 120, dt: float = 0.05, limit: float = 40, cap: float | None = None,
               slots: int = 2, latency: float = 0.2, grants: list[float] | None = None) -> tuple[float, float]:
    """A fluid model of the issue's site, 2 slots x 0.2 s behind 40 req/s, at most 24 requests
    in flight (8 per host per worker, 3 workers): (median response after a minute, req/s served).
    Answers are recorded when they come; the monitor looks once a second, as ``Adaptation`` does:
    the buckets that ended a second ago, then (in slow start) the answers since its last look.
    ``cap``: capacity discovery's ceiling; ``grants`` collects the rate granted at each step."""
    c, queue, t, credit = Controller(), 0.0, T0, 0.0
    capacity = slots / latency
    pending: list[tuple[float, float]] = []  # (answered at, response s)
    buckets: dict[int, dict[int, int]] = {}
    since_look: dict[int, int] = {}
    looked = T0
    responses, served = [], 0.0
    while t < T0 + seconds:
        rate = c.rate(limit, cap) if enabled else limit
        if grants is not None:
            grants.append(rate)
        arrived = min(rate * dt, max(0.0, 24 - queue))
        queue += arrived
        done = min(queue, capacity * dt)
        queue -= done
        response = latency + max(0.0, queue - slots) / capacity
        credit += arrived
        while credit >= 1:
            credit -= 1
            pending.append((t + response, response))
            if t >= T0 + 60:
                responses.append(response)
        served += done if t >= T0 + 60 else 0
        t += dt
        for answer in [p for p in pending if p[0] <= t]:
            pending.remove(answer)
            for bins in (buckets.setdefault(bucket_start(answer[0]), {}), since_look):
                bins[bin_of(answer[1])] = bins.get(bin_of(answer[1]), 0) + 1
        if t >= looked + 1:
            for start in sorted(b for b in buckets if b + RESPONSE_BUCKET_SECONDS + 1 <= t):
                c.observe(Reading(start, buckets.pop(start)), limit, t, enabled, cap=cap)
            if enabled and since_look and c.slow_start:
                c.observe_fresh(Reading(looked, since_look), limit, t, cap)
            since_look, looked = {}, t
    return statistics.median(responses), served / (seconds - 60)


def test_the_model_site_stays_responsive_and_busy_only_with_adaptation() -> None:
    median, served = model_site(enabled=True)
    assert median <= 0.6 and served >= 4, (median, served)
    median, served = model_site(enabled=False)
    assert median > 2 and served == pytest.approx(10, rel=0.05)


@pytest.mark.parametrize("slots, latency, cap", [(6, 0.2, 40), (3, 0.1, 40), (30, 0.5, 40), (2, 0.05, 32)])
def test_discovery_holds_a_list_site_near_its_capacity_and_never_above_the_ceiling(slots, latency, cap) -> None:
    """A 1 req/s list site that can take ``slots / latency`` (30-60 req/s): discovery climbs past
    its limit to near that capacity, its median within 3x unloaded, and never past ``cap``."""
    grants: list[float] = []
    median, served = model_site(enabled=True, seconds=180, limit=1, cap=cap, slots=slots, latency=latency,
                                grants=grants)
    capacity = min(slots / latency, cap)
    assert median <= 3 * latency and served >= 0.6 * capacity, (median, served)
    assert max(grants) <= cap


def test_discovery_climbs_only_while_answers_stay_fast() -> None:
    """Multiplicatively in the slow start, then by steps; never past the cap; down at the first slow-down."""
    c = Controller()
    assert c.rate(1, 32) == pytest.approx(6.4)  # a 1 req/s list site starts at a fifth of its cap...
    rates = []
    for i in range(12):
        c.observe_fresh(fresh(T0 + i, 30, n=40), 1, T0 + i + 1, 32)
        rates.append(c.rate(1, 32))
    # each grant held for a second of answers to its own requests (a look more for their lag)
    assert rates == pytest.approx([12.8, 12.8, 25.6, 25.6, 32, 32, 32, 32, 32, 32, 32, 32])
    assert not c.slow_start  # ... and doubles to it
    assert c.observe(reading(T0 + 20, 300), 1, T0 + 23, cap=32) == DOWN  # 10x its unloaded time
    assert c.rate(1, 32) == pytest.approx(32 * 0.7)
    assert c.observe(reading(T0 + 24, 30), 1, T0 + 27, cap=32) == UP
    assert c.rate(1, 32) == pytest.approx(32 * 0.7 + 1)  # + max(1 req/s, 2% of the cap)
    assert c.rate(1) == 1 and c.rate(1, None) == 1  # no cap (discovery off, an override): its limit
    assert c.rate(40, 32) == 40  # a cap below the limit never lowers it


@pytest.mark.parametrize("level, evidence", [(0.1, (3, 0.0)), (0.99, (3, 0.0)), (1.0, (4, 0.9)), (12.8, (4, 0.9))])
def test_a_doubling_past_the_limit_needs_more_answers_over_a_second(level, evidence) -> None:
    assert doubling_evidence(level) == evidence
    assert start_share(1, 32) == pytest.approx(6.4)  # a fifth of discovery's ceiling
    assert start_share(40, 32) == start_share(40, None) == 0.1  # a tenth of a limit with nothing to discover


@pytest.mark.parametrize("answers, verdicts", [
    # (ms, answers) per look, 1 s apart, at 3.2 req/s then at each grant the verdicts give
    ([(30, 2), (30, 2), (30, 2), (30, 2)], [WAIT, UP, WAIT, HOLD]),          # 4 answers before a doubling, to
                                                                              # twice the 2 a second answered
    ([(30, 9)] * 5, [UP, HOLD, UP, HOLD, UP]),                                # a second at each grant, a look
                                                                              # more for its answers to come
    ([(207, 4), (207, 4), (215, 4), (230, 4), (215, 4)], [UP, HOLD, UP, HOLD, HOLD]),  # 4-10% slower: not load
    ([(200, 8), (200, 8), (330, 8), (330, 8)], [UP, HOLD, HOLD, HOLD]),      # past 1.5x: held, not doubled
    ([(200, 8), (200, 8), (500, 8)], [UP, HOLD, HOLD]),                       # past 2x and +100 ms once: held
    ([(200, 8), (200, 8), (500, 8), (500, 8)], [UP, HOLD, HOLD, DOWN]),       # and again: one back
    ([(200, 8), (200, 8), (1804, 8), (200, 8), (200, 8), (200, 8), (200, 8)],  # a late worker's one look:
     [UP, HOLD, HOLD, UP, HOLD, UP, HOLD]),                                    # doubles on after a second of fast
    ([(200, 8), (200, 8), (1804, 8), (200, 8), (1804, 8)], [UP, HOLD, HOLD, UP, HOLD]),  # fast between: unconfirmed
])
def test_the_discovery_slow_start_doubles_only_on_enough_fresh_fast_answers(answers, verdicts, monkeypatch) -> None:
    monkeypatch.setattr(adaptive, "ADAPTIVE_DISCOVERY_START_SHARE", 0.1)  # the rules of evidence, from 3.2 req/s
    c = Controller()
    got = [c.observe_fresh(fresh(T0 + i, ms, n=n), 1, T0 + i + 1, 32) for i, (ms, n) in enumerate(answers)]
    assert got == verdicts
    if verdicts[-1] == DOWN:  # 8 answers a second at 500 ms against 200: drained at half of that, then landed
        assert c.rate(1, 32) == pytest.approx(4.0) and not c.slow_start
        # a queue of its slowest answers (the 90th percentile, ~0.5 s in their bin) drains at half in ~0.6 s
        assert not c.land(T0 + len(answers) + 0.55) and c.land(T0 + len(answers) + 0.65)
        assert c.rate(1, 32) == pytest.approx(6.4)  # 90% of 8 a second, but never above the rate that was slow


def test_a_doubling_waits_for_a_look_of_answers_not_for_a_whole_second() -> None:
    """The monitor looks about once a second, now and then a little early: a doubling past the limit
    needs a look of answers at the grant, so 0.95 s of them is not made up with older ones, at the last
    grant's rate, which would cap it at less than a doubling."""
    c = Controller(multiplier=6.4, changed_at=T0 - 1.2, baseline_ms=200, baseline_at=T0)
    assert c.observe_fresh(fresh(T0 - 1, 200, n=4), 1, T0, 32) == HOLD          # partly the last grant's answers
    assert c.observe_fresh(fresh(T0, 200, n=6), 1, T0 + 0.95, 32) == UP          # 6 in 0.95 s: proof of 6.3 a second
    assert c.rate(1, 32) == pytest.approx(12.6, rel=0.01)


def test_an_overrun_lands_by_what_the_site_served_over_both_slow_looks() -> None:
    """A second's count is a few answers either way; the landing takes both slow looks (the first
    and the one that confirms it) so a lucky second does not land it at the site's capacity."""
    c = Controller(multiplier=12.8, changed_at=T0 - 2, baseline_ms=200, baseline_at=T0)
    assert c.observe_fresh(fresh(T0, 600, n=8), 1, T0 + 1, 32) == HOLD          # slow: confirmed by the next look
    assert c.observe_fresh(fresh(T0 + 1, 900, n=12), 1, T0 + 2, 32) == DOWN      # 20 answers over the 2 s
    assert c.rate(1, 32) == pytest.approx(5.0)                                    # drained at half of 10 a second
    assert c.land(T0 + 10) and c.rate(1, 32) == pytest.approx(9.0)                # then 90% of it, not of 12


@pytest.mark.parametrize("level, served, slow_ms, baseline_ms, lowest, expected", [
    # doubled past a 10.75 req/s site: 10.4 requests waited 0.97 s, and 10.7 more were sent past what
    # it served while their answers took 1.17 s to tell: 21.1 drain at 5.375 a second
    (19.9, 10.75, 1169, 200, 1.0, (5.375, 3.928, 9.675)),
    (12.8, 10.75, 420, 200, 1.0, (5.375, 0.6, 9.675)),      # just past it: a short drain
    (6.4, 8.0, 500, 200, 1.0, (4.0, 0.6, 6.4)),             # it served more than we sent: never above the level
    (3.2, 0.5, 900, 300, 1.0, (1.0, 0.0, 1.0)),             # never below the floor, where nothing drains
    (0.4, 0.3, 800, 200, 0.025, (0.15, 1.733, 0.27)),       # below a catalog source's limit alike
    (32, 1.0, 8000, 200, 0.03125, (0.5, 30.0, 0.9)),        # 32 a second to a site serving 1: at most 30 s
])
def test_an_overrun_slow_start_drains_its_queue_then_lands_near_what_the_site_served(
        level, served, slow_ms, baseline_ms, lowest, expected) -> None:
    assert landing(level, served, slow_ms, baseline_ms, lowest) == pytest.approx(expected, abs=1e-3)


def test_no_verdict_while_an_overrun_drains_and_a_fresh_one_after_it_lands() -> None:
    c = Controller(multiplier=2.0, slow_start=False, baseline_ms=200, baseline_at=T0, drain_until=T0 + 3,
                   landing_multiplier=9.0)
    assert c.observe(reading(T0, 900), 1, T0 + 2, cap=32) == HOLD and c.rate(1, 32) == 2.0  # slow, but draining
    assert c.observe(reading(T0 + 2, 200), 1, T0 + 4, cap=32) == WAIT  # landed: only later buckets judge it
    assert c.rate(1, 32) == 9.0 and c.changed_at == T0 + 4
    restored = Controller.restored(Controller(drain_until=T0 + 3, landing_multiplier=9.0, slow_start=False).saved(
        1, True, 32))
    assert (restored.drain_until, restored.landing_multiplier) == (T0 + 3, 9.0)


async def test_a_landed_source_keeps_no_drain_for_a_monitor_taking_over() -> None:
    """SPEC.md: ``drain_until`` and ``landing_multiplier`` are there only while it drains; left in
    ``adaptive:{source}`` after the landing, the next monitor would land it there again."""
    redis = FakeAsyncRedis()
    now = [T0 + 0.5]
    adaptation = Adaptation(redis, clock=lambda: now[0])
    await adaptation.meet(["site"])
    adaptation.controllers["site"] = Controller(multiplier=0.25, slow_start=False, baseline_ms=200, baseline_at=T0,
                                                changed_at=T0, drain_until=T0 + 2, landing_multiplier=0.45)
    adaptation.effective("site", 20)
    await adaptation.update()
    assert float(redis.store.hgetall(contracts.adaptive_key("site"))["drain_until"]) == T0 + 2
    now[0] = T0 + 2.5
    adaptation.effective("site", 20)
    await adaptation.update()
    saved = redis.store.hgetall(contracts.adaptive_key("site"))
    assert "drain_until" not in saved and "landing_multiplier" not in saved
    successor = Adaptation(redis, clock=lambda: now[0])
    await successor.meet(["site"])
    assert successor.controllers["site"].drain_until is None and successor.effective("site", 20) == 9.0


@pytest.mark.parametrize("answers, verdicts", [
    # (ms, count) a look from the drain's start at T0: answers to requests made during it at the site's
    # unloaded speed end it at once; slower ones, too few, or those to requests made before it do not
    ([(200, 3)], [UP]),
    ([(230, 3)], [UP]),                      # within 1.2x: nothing waited ahead of them
    ([(700, 4), (400, 3), (210, 3)], [HOLD, HOLD, UP]),
    ([(200, 2), (200, 1)], [HOLD, UP]),       # a few, over two looks
    ([(300, 3), (300, 3)], [HOLD, HOLD]),    # within 1.5x is not drained: the computed length still ends it
])
def test_a_drain_ends_once_answers_to_requests_made_during_it_come_at_unloaded_speed(answers, verdicts) -> None:
    c = Controller(multiplier=2.0, slow_start=False, baseline_ms=200, baseline_at=T0, changed_at=T0,
                   drain_until=T0 + 20, landing_multiplier=9.0)
    assert c.observe_drain(fresh(T0, 200), T0 + 0.4) == WAIT  # answers to requests made before it
    got = [c.observe_drain(fresh(T0 + 1 + i, ms, n), T0 + 2 + i) for i, (ms, n) in enumerate(answers)]
    assert got == verdicts
    assert (c.rate(1, 32), c.drain_until) == ((9.0, None) if verdicts[-1] == UP else (2.0, T0 + 20))


@pytest.mark.parametrize("verdict, overload, slow_before, move", [
    ("slow", False, False, HOLD),   # one slow median: a worker's late loop, or the site? hear more
    ("slow", False, True, DOWN),    # confirmed by the next answers: the site
    ("slow", True, False, DOWN),    # timeouts, 429/503: at once
    ("fast", False, True, UP),
    ("fast", False, False, UP),
    (None, False, True, HOLD),      # between 1.5x and 2x: neither
])
def test_the_slow_start_ends_on_overload_or_a_confirmed_slow_median(verdict, overload, slow_before, move) -> None:
    assert slow_start_move(verdict, overload, slow_before) == move


@pytest.mark.parametrize("per_second, rates", [
    (2, [6.4] * 6),                              # the workers send 2 a second: 4 req/s at most, below the start
    (5, [10] * 6),                               # 5 a second: twice that at once
    (10, [12.8, 12.8, 20, 20, 20, 20]),          # 10 a second: a doubling, then twice that
    (40, [12.8, 12.8, 25.6, 25.6, 32, 32]),      # as granted: doubles to the ceiling
])
def test_a_discovering_grant_grows_to_at_most_twice_what_the_site_answered(per_second, rates) -> None:
    c = Controller()
    got = []
    for i in range(6):
        c.observe_fresh(fresh(T0 + i, 30, n=per_second), 1, T0 + i + 1, 32)
        got.append(c.rate(1, 32))
    assert got == pytest.approx(rates)


def test_discovery_reaches_its_cap_within_seconds_of_the_first_request() -> None:
    """A 1 req/s list site answering in 200 ms at any rate: 32 req/s within 8.5 s (12 s when a
    doubling waited for 8 answers over 2 s). Modelled as ``test_the_slow_start_reaches_any_limit_within_seconds``."""
    c, t, sent, answers, looked = Controller(), T0, T0, [], T0
    while c.rate(1, 32) < 32 and t < T0 + 30:
        t += 0.01
        while sent + 1 / c.rate(1, 32) <= t:
            sent += 1 / c.rate(1, 32)
            answers.append(sent + 0.3)
        if t >= looked + 1:
            n = sum(looked < at <= t for at in answers)
            if n:
                c.observe_fresh(fresh(looked, 200, n=n), 1, t, 32)
            looked = t
    assert t - T0 <= 8.5


@pytest.mark.parametrize("slots, latency", [(2, 0.186), (2, 0.229), (3, 0.25), (2, 0.15)])
def test_discovery_hears_a_fragile_site_before_twice_its_capacity(slots, latency) -> None:
    """A 1 req/s list site of 8-13 req/s capacity, 32 req/s cap: the slow start stops by about
    twice its capacity (a doubling from just below it), and its median stays within 3x unloaded."""
    grants: list[float] = []
    median, _ = model_site(enabled=True, seconds=120, limit=1, cap=32, slots=slots, latency=latency, grants=grants)
    assert max(grants) <= 2.2 * slots / latency and median <= 3 * latency, (max(grants), median)


def answered(store, source: str, at: float, seconds: float, times: int) -> None:
    """What a worker's Stats.record leaves: the response bucket, and the source marked active."""
    store.hincrby(contracts.response_times_key(source, bucket_start(at)), str(bin_of(seconds)), times)
    store.zadd(contracts.ACTIVE_SOURCES, {source: at}, gt=True)


async def test_the_regulator_grants_what_the_back_off_allows_from_redis() -> None:
    redis = FakeAsyncRedis()
    store = redis.store
    store.sadd(contracts.INBOUND_SOURCES, "slow", "off")
    store.zadd(contracts.ACTIVE_SOURCES, {"slow": T0 + 10**6, "off": T0 + 10**6})  # being crawled throughout
    store.set(contracts.override_rate_key("slow"), 40)
    store.set(contracts.override_rate_key("off"), 40)
    store.set(contracts.adaptive_off_key("off"), "1")
    now = [T0 + 0.5]
    adaptation = Adaptation(redis, clock=lambda: now[0])
    regulator = Regulator(redis, adaptation)
    assert await regulator.tick(now[0]) == {"slow": 4, "off": 40}  # new: slow start, unless switched off
    for second in range(1, 40):
        now[0] = T0 + 0.5 + second
        for source in ("slow", "off"):
            answered(store, source, now[0], 0.2, 5)
        await adaptation.update()
        await regulator.tick(now[0])
    assert regulator.rates == {"slow": 40, "off": 40}
    saved = store.hgetall(contracts.adaptive_key("slow"))
    assert float(saved["baseline_ms"]) == pytest.approx(200, rel=0.1) and saved["enabled"] == "1"
    assert store.hgetall(contracts.adaptive_key("off"))["enabled"] == "0"
    assert store.expiry[contracts.adaptive_key("slow")] > 60
    # Slow answers: the grant drops within seconds; a new monitor continues from the saved state.
    for second in range(40, 50):
        now[0] = T0 + 0.5 + second
        answered(store, "slow", now[0], 1.5, 10)
        await adaptation.update()
        await regulator.tick(now[0])
    assert regulator.rates["slow"] < 40 * 0.7 * 0.7 + 1e-9
    # From its first grant: granted a slow start's tenth until its first update, a restarted
    # monitor had the workers park URLs by it (test_monitor_stopped_requests_stop_then_resume).
    successor = Regulator(redis, Adaptation(redis, clock=lambda: now[0]))
    await successor.tick(now[0])
    assert successor.rates["slow"] == pytest.approx(regulator.rates["slow"], rel=0.01)
    assert successor.rates["off"] == 40


async def test_each_second_reads_and_saves_only_the_sources_with_answers() -> None:
    """Issue 20: at 5,000 sources, reading every source's bucket each second took the monitor's
    whole second. Quiet sources are not read or rewritten; a changed ceiling is still saved."""
    redis = FakeAsyncRedis()
    store = redis.store
    now = [T0 + 0.5]
    adaptation = Adaptation(redis, clock=lambda: now[0])
    quiet = [f"quiet{n}" for n in range(1000)]
    for source in ["busy", *quiet]:
        adaptation.effective(source, 40)
    await adaptation.update()
    for source in quiet:  # the first update saves every new source once
        store.delete(contracts.adaptive_key(source))
    for second in range(1, 30):
        now[0] = T0 + 0.5 + second
        answered(store, "busy", now[0], 0.2, 5)
        adaptation.effective("busy", 40)  # as the regulator asks each second for the sources it ticks
        await adaptation.update()
    assert adaptation.controllers["busy"].multiplier == 1.0  # slow start ran to the ceiling
    assert all(not store.hgetall(contracts.adaptive_key(source)) for source in quiet)
    assert adaptation.controllers["quiet0"].multiplier == ADAPTIVE_START_SHARE
    adaptation.effective("quiet0", 80)  # the operator raised its override
    await adaptation.update()
    assert float(store.hgetall(contracts.adaptive_key("quiet0"))["ceiling"]) == 80
    assert not store.hgetall(contracts.adaptive_key("quiet1"))


async def test_a_new_source_is_judged_each_second_on_the_answers_since_the_last_look() -> None:
    """Issue 28: the slow start reads the open buckets each second and counts each answer once."""
    redis = FakeAsyncRedis()
    store = redis.store
    now = [T0 + 0.5]
    adaptation = Adaptation(redis, clock=lambda: now[0])
    assert adaptation.effective("new", 40) == 4
    answered(store, "new", now[0] - 0.3, 0.03, 2)
    await adaptation.update()
    assert adaptation.effective("new", 40) == 4       # two answers are not yet a few
    now[0] += 1
    await adaptation.update()                          # nothing new: the two are not counted again
    assert adaptation.effective("new", 40) == 4
    for second in range(2, 6):
        now[0] = T0 + 0.5 + second
        answered(store, "new", now[0] - 0.3, 0.03, 1 if second == 2 else 5)
        await adaptation.update()
    assert adaptation.effective("new", 40) == 40      # 8, 16, 32, 40: a second each
    assert not adaptation.controllers["new"].slow_start
    assert float(store.hgetall(contracts.adaptive_key("new"))["effective_rate"]) == 40



async def test_a_source_back_in_the_window_does_not_count_its_answers_again() -> None:
    """A slow-starting source with two answers leaves the back-off's window (no answer since the
    oldest due bucket began) and is back in it at the next due bucket, its two answers still in an
    open bucket: they were counted again as new, and two answers doubled its grant (4 -> 8)."""
    redis = FakeAsyncRedis()
    store = redis.store
    now = [T0 + 0.5]
    adaptation = Adaptation(redis, clock=lambda: now[0])
    grants = []
    for second in range(12):
        now[0] = T0 + 0.5 + second
        if second == 6:
            answered(store, "two", now[0] - 0.3, 0.03, 2)
        adaptation.effective("two", 40)
        await adaptation.update()
        grants.append(adaptation.effective("two", 40))
    assert grants == [4.0] * 12
    assert sum(r.total for r in adaptation.controllers["two"].fresh) == 2

async def test_a_draining_source_lands_at_the_first_look_its_answers_are_fast_again() -> None:
    """The monitor reads a draining source's open buckets each second, as a slow-starting one's:
    its queue at the site gone, it lands then, not when the drain's computed length ends."""
    redis = FakeAsyncRedis()
    store = redis.store
    now = [T0 + 0.5]
    adaptation = Adaptation(redis, clock=lambda: now[0])
    await adaptation.meet(["site"])
    adaptation.controllers["site"] = Controller(multiplier=0.25, slow_start=False, baseline_ms=200, baseline_at=T0,
                                                changed_at=T0, drain_until=T0 + 20, landing_multiplier=0.45)
    for second, ms in enumerate([900, 600, 200], start=1):  # answers to requests made before the drain, then after
        now[0] = T0 + 0.5 + second
        answered(store, "site", now[0] - 0.3, ms / 1000, 4)
        adaptation.effective("site", 20)
        await adaptation.update()
        assert adaptation.effective("site", 20) == (9.0 if ms == 200 else 5.0)
    assert "drain_until" not in store.hgetall(contracts.adaptive_key("site"))


def test_a_source_answering_now_and_then_is_judged_on_the_last_minute_only() -> None:
    """Buckets without answers are not observed, so old ones leave the window by time."""
    controller = Controller(multiplier=1.0, slow_start=False)
    controller.observe(Reading(T0, {bin_of(0.2): 20}), 10, T0)
    controller.observe(Reading(T0 + 2 * RESPONSE_BUCKET_SECONDS * ADAPTIVE_READINGS_KEPT, {bin_of(0.2): 1}), 10,
                       T0 + 120)
    assert [r.start for r in controller.readings] == [T0 + 2 * RESPONSE_BUCKET_SECONDS * ADAPTIVE_READINGS_KEPT]


def test_a_discovered_rate_is_not_kept_while_discovery_is_off() -> None:
    """Switched off (an override, DISCOVERY_SOURCES=none), a source falls to its limit at once, and
    switched back on it climbs again from there rather than jumping to what it had found."""
    adaptation = Adaptation(FakeAsyncRedis(), clock=lambda: T0)
    adaptation.controllers["site"] = Controller(multiplier=20.0, slow_start=False)
    assert adaptation.effective("site", 1.0, 32.0) == 20.0
    assert adaptation.effective("site", 1.0) == 1.0
    assert adaptation.effective("site", 1.0, 32.0) == 1.0


@pytest.mark.parametrize("fields, held, held_for, written", [
    ({"m": "0.2", "drain_until": ""}, None, 0.0, {"m": "0.2", "drain_until": ""}),  # not known: all, deletions too
    ({"m": "0.2", "drain_until": ""}, {}, float("inf"), {"m": "0.2"}),               # a new hash: nothing to delete
    ({"m": "0.2", "drain_until": ""}, {"m": "0.1", "drain_until": "5"}, 1.0, {"m": "0.2", "drain_until": ""}),
    ({"m": "0.2", "drain_until": ""}, {"m": "0.2", "drain_until": ""}, 1.0, None),   # unchanged, renewed lately
    ({"m": "0.2", "drain_until": ""}, {"m": "0.2", "drain_until": ""}, ADAPTIVE_STATE_RENEW_SECONDS, {"m": "0.2"}),
    ({"m": "0.2", "drain_until": ""}, {"m": "0.2"}, float("inf"), {"m": "0.2"}),     # as read: written again
])
def test_a_save_writes_only_what_the_hash_does_not_hold(fields, held, held_for, written) -> None:
    assert to_write(fields, held, held_for) == written


async def test_a_one_url_source_is_saved_once_and_a_judged_one_renewed_within_a_minute() -> None:
    """Issue 44: a source with one answer was saved at each look that found it (its unchanged
    state, with the deletions of drain fields it never had); now once, and a state unchanged
    while judged is written again within ADAPTIVE_STATE_RENEW_SECONDS, renewing its hour."""
    store = RecordingStore()
    redis = FakeAsyncRedis(store)
    now = [T0 + 0.5]
    adaptation = Adaptation(redis, clock=lambda: now[0])
    regulator = Regulator(redis, adaptation)
    store.set(contracts.override_rate_key("one"), 5)
    store.zadd(contracts.WAITING_SOURCES, {"one": now[0]})
    for second in range(8):
        now[0] = T0 + 0.5 + second
        if second == 1:
            answered(store, "one", now[0] - 0.3, 0.03, 1)
        await adaptation.update()
        await regulator.tick(now[0])
    writes = [args for name, args, _ in store.commands if name in ("hset", "hdel")
              and args[0] == contracts.adaptive_key("one")]
    assert [name for name, *_ in store.commands if name == "hdel"] == []
    assert len(writes) == 1 and float(store.hgetall(contracts.adaptive_key("one"))["effective_rate"]) == 1.0
    # A busy source at its ceiling, answering at twice its baseline: each bucket judged, neither
    # slow nor fast, so nothing changes; written at its first verdict, then once a minute.
    adaptation.controllers["busy"] = Controller(multiplier=1.0, slow_start=False, baseline_ms=200, baseline_at=now[0])
    store.commands.clear()
    for _ in range(int(2 * ADAPTIVE_STATE_RENEW_SECONDS)):
        now[0] += 1
        answered(store, "busy", now[0], 0.4, 20)
        adaptation.effective("busy", 40)
        await adaptation.update()
    renewals = [args for name, args, _ in store.commands if name == "expire"
                and args[0] == contracts.adaptive_key("busy")]
    assert 2 <= len(renewals) <= 3


async def test_open_buckets_are_read_while_answers_come_not_at_each_look() -> None:
    """Issue 44: a slow-starting source's open buckets were read at each look while it was active
    (a one-URL site ~4 looks of two buckets); now at the looks within the workers' slack of an
    answer: the two after it (before: also the third, at 3), and again once a new one comes."""
    store = RecordingStore()
    redis = FakeAsyncRedis(store)
    now = [T0 + 0.5]
    adaptation = Adaptation(redis, clock=lambda: now[0])
    looks = []
    for second in range(9):
        now[0] = T0 + 0.5 + second
        if second in (1, 6):
            answered(store, "one", now[0] - 0.3, 0.03, 1)
        adaptation.effective("one", 5)
        store.commands.clear()
        await adaptation.update()
        newest = contracts.response_times_key("one", bucket_start(now[0]))  # open, never a completed one
        if any(name == "hgetall" and args[0] == newest for name, args, _ in store.commands):
            looks.append(second)
    assert looks == [1, 2, 6, 7]


@pytest.mark.parametrize("change", [
    {"multiplier": 0.5}, {"slow_start": False}, {"baseline_ms": 120.0}, {"baseline_at": T0 + 1},
    {"recent_ms": 150.0}, {"changed_at": T0 + 2}, {"drain_until": T0 + 3}, {"landing_multiplier": 0.4},
])
def test_a_state_that_saves_other_fields_is_another_state(change) -> None:
    """The save skips a source whose ``state`` is what it last wrote (without formatting its fields):
    whatever ``saved`` writes differently must be a different state."""
    base = dict(multiplier=0.2, slow_start=True, baseline_ms=100.0, baseline_at=T0, recent_ms=110.0, changed_at=T0,
                drain_until=T0 + 5, landing_multiplier=0.3)
    before, after = Controller(**base), Controller(**{**base, **change})
    assert before.saved(5.0, True) != after.saved(5.0, True)
    assert before.state(5.0, True) != after.state(5.0, True)
    others = (before.state(5.0, False), before.state(5.0, True, 32.0), before.state(6.0, True))
    assert before.state(5.0, True) not in others
