"""The adaptive back-off's decisions (crawl_monitor.adaptive), with fakes and a model site."""
from __future__ import annotations

import statistics

import pytest

from common import contracts
from common.response_times import OVERLOAD_FIELD, RESPONSE_BUCKET_SECONDS, bin_of, bucket_start, median_ms, parse_bucket
from crawl_monitor.adaptive import DOWN, HOLD, OFF, UP, WAIT, Adaptation, Controller, Reading
from crawl_monitor.constants import ADAPTIVE_FLOOR_RPS, ADAPTIVE_READINGS_KEPT, ADAPTIVE_START_SHARE
from crawl_monitor.regulator import Regulator
from test.test_monitor_fakes import FakeAsyncRedis

T0 = 1_000_000.0


def reading(start: float, ms: float, n: int = 20, overload: int = 0) -> Reading:
    return Reading(int(start), {bin_of(ms / 1000): n} if n else {}, overload)


def test_bins_give_the_median_within_a_bin_and_ignore_junk() -> None:
    samples = [0.05 * (1 + i % 7) for i in range(101)]
    bins: dict[int, int] = {}
    for s in samples:
        bins[bin_of(s)] = bins.get(bin_of(s), 0) + 1
    assert median_ms(bins) == pytest.approx(statistics.median(samples) * 1000, rel=0.2)
    assert bin_of(0) == 0 == bin_of(float("nan")) and bin_of(10_000) == 68  # clamped both ways
    assert parse_bucket({"12": "3", "x": "9", "13": "-1", "14": "abc", OVERLOAD_FIELD: "2", "999": "1"}) == ({12: 3}, 2)
    assert median_ms({}) is None


def test_slow_start_doubles_from_a_tenth_while_answers_stay_fast() -> None:
    c = Controller()
    assert c.rate(40) == 4.0
    verdicts = [c.observe(reading(T0 + 2 * i, 200), 40, T0 + 2 * i + 3) for i in range(9)]
    # Each change is judged on buckets started after it: every other bucket is fresh.
    assert verdicts[:7] == [UP, WAIT, UP, WAIT, UP, WAIT, UP]
    assert c.multiplier == 1.0 and not c.slow_start and c.rate(40) == 40
    assert verdicts[7:] == [WAIT, HOLD]


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
    fresh = Controller.restored({"multiplier": "nan", "baseline_ms": "-3", "baseline_at": "x"})
    assert (fresh.multiplier, fresh.slow_start, fresh.baseline_ms) == (Controller().multiplier, True, None)


def model_site(enabled: bool, seconds: float = 120, dt: float = 0.05) -> tuple[float, float]:
    """A fluid model of the issue's site, 2 slots x 0.2 s behind 40 req/s, at most 24 requests
    in flight (8 per host per worker, 3 workers): (median response after a minute, req/s served)."""
    c, queue, t, credit = Controller(), 0.0, T0, 0.0
    bins: dict[int, int] = {}
    start = bucket_start(t)
    responses, served = [], 0.0
    while t < T0 + seconds:
        rate = c.rate(40) if enabled else 40
        arrived = min(rate * dt, max(0.0, 24 - queue))
        queue += arrived
        done = min(queue, 10 * dt)
        queue -= done
        response = 0.2 + max(0.0, queue - 2) / 10
        credit += arrived
        while credit >= 1:
            credit -= 1
            bins[bin_of(response)] = bins.get(bin_of(response), 0) + 1
            if t >= T0 + 60:
                responses.append(response)
        served += done if t >= T0 + 60 else 0
        t += dt
        if bucket_start(t - 1) - 2 >= start:
            c.observe(Reading(start, bins), 40, t, enabled)
            bins, start = {}, start + 2
    return statistics.median(responses), served / (seconds - 60)


def test_the_model_site_stays_responsive_and_busy_only_with_adaptation() -> None:
    median, served = model_site(enabled=True)
    assert median <= 0.6 and served >= 4, (median, served)
    median, served = model_site(enabled=False)
    assert median > 2 and served == pytest.approx(10, rel=0.05)


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
    assert await regulator.tick(now[0]) == {"slow": 4, "off": 4}  # new: slow start, the switch not read yet
    await adaptation.update()
    assert await regulator.tick(now[0]) == {"slow": 4, "off": 40}
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
    successor = Adaptation(redis, clock=lambda: now[0])
    assert successor.effective("slow", 40) == 4  # until it has read the saved state
    await successor.update()
    assert successor.effective("slow", 40) == pytest.approx(regulator.rates["slow"], rel=0.01)


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


def test_a_source_answering_now_and_then_is_judged_on_the_last_minute_only() -> None:
    """Buckets without answers are not observed, so old ones leave the window by time."""
    controller = Controller(multiplier=1.0, slow_start=False)
    controller.observe(Reading(T0, {bin_of(0.2): 20}), 10, T0)
    controller.observe(Reading(T0 + 2 * RESPONSE_BUCKET_SECONDS * ADAPTIVE_READINGS_KEPT, {bin_of(0.2): 1}), 10,
                       T0 + 120)
    assert [r.start for r in controller.readings] == [T0 + 2 * RESPONSE_BUCKET_SECONDS * ADAPTIVE_READINGS_KEPT]
