"""The circuit breaker's two halts at their boundaries (SPEC.md §3), on a fake Redis and a fake clock."""
from __future__ import annotations

import json
import uuid

import pytest

from common import contracts
from crawl_monitor.circuit_breaker import CircuitBreaker, error_surge, healthy_tail, surge_of_errors
from crawl_monitor.constants import BREAKER_FULL_PASS_SECONDS
from test.test_monitor_fakes import FakeAsyncRedis

T0 = 1_800_000_000.0


@pytest.fixture
def redis() -> FakeAsyncRedis:
    store = FakeAsyncRedis()
    store.store.sadd(contracts.INBOUND_SOURCES, "example")
    return store


def record(redis: FakeAsyncRedis, statuses: list[str], at: float, source: str = "example") -> None:
    """What a worker writes per request: every window, the last-50 list, and the source as active."""
    redis.store.zadd(contracts.ACTIVE_SOURCES, {source: at}, gt=True)
    for status in statuses:
        redis.store.zadd(contracts.one_minute_window_key(source), {f"{status}:{uuid.uuid4().hex}": at})
        for prefix, (_seconds, bucket) in contracts.STATUS_COUNT_WINDOWS.items():
            field = contracts.status_count_field(int(at // bucket * bucket), status)
            redis.store.hincrby(contracts.status_window_key(prefix, source), field, 1)
        redis.store.rpush(contracts.last_50_key(source), status)
        del redis.store.data[contracts.last_50_key(source)][:-contracts.LAST_50_LENGTH]


def logged(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.parametrize("errors, halts", [(10, False), (11, True)])
async def test_a_surge_of_errors_halts_temporarily(redis, capsys, errors, halts) -> None:
    record(redis, ["200"] * (100 - errors) + ["500"] * errors, at=T0 - 30)
    await CircuitBreaker(redis).check(T0)
    assert ("example" in redis.store.smembers(contracts.TEMP_HALTED)) is halts
    lines = logged(capsys)
    if halts:
        assert len(lines) == 1
        assert set(lines[0]) == {"event", "time", "type", "msg", "source"}
        assert (lines[0]["event"], lines[0]["type"], lines[0]["source"]) == ("crawl_halted", "temporary", "example")
        assert f'"500": {errors}' in lines[0]["msg"]
    else:
        assert lines == []


@pytest.mark.parametrize("errors, total, surge", [
    (0, 9, False), (9, 9, False),     # too few to judge
    (3, 10, False), (4, 10, True),    # the tail binds
    (4, 20, False), (5, 20, True),
    (7, 61, False), (8, 61, True),    # a minute at 1 req/s: 7 is 11.5%, but 1 healthy minute in 433 shows it
    (12, 122, False), (13, 122, True),
    (10, 100, False), (11, 100, True),  # above 10% binds
    (30, 306, False), (31, 306, True),
    (100, 1000, False), (101, 1000, True),
    (12, 600, False),                 # 2%
])
def test_a_surge_is_above_ten_percent_and_unlikely_for_a_healthy_site(errors, total, surge) -> None:
    assert error_surge(errors, total) is surge
    assert surge_of_errors(["500"] * errors + ["404"] * (total - errors)) is surge


@pytest.mark.parametrize("errors, total, tail", [
    (0, 5, 1.0), (6, 5, 0.0), (3, 3, 2.7e-5), (5, 100, 0.182145), (7, 61, 0.00230963), (8, 61, 0.000467680),
    (13, 122, 8.28081e-5), (154, 1530, 8.02086e-38),
])
def test_the_binomial_tail_of_a_healthy_site(errors, total, tail) -> None:
    assert healthy_tail(errors, total) == pytest.approx(tail, rel=1e-5)


def crawl_seconds(rate: int, error_share: float, seconds: int, seed: int) -> list[list[str]]:
    """What the minute window gets each second from a site crawled at ``rate`` whose answers fail
    at random: a failed URL's error, and its retry's answer if it succeeds (the retry's failure
    is not counted again)."""
    import random
    rng = random.Random(seed)
    per_second = []
    for _ in range(seconds):
        statuses = []
        for _ in range(rate):
            if rng.random() < error_share:
                statuses.append("500")
                if rng.random() >= error_share:
                    statuses.append("200")
            else:
                statuses.append("200")
        per_second.append(statuses)
    return per_second


async def halted_after(rate: int, error_share: float, seconds: int, seed: int) -> int | None:
    """The seconds of crawl after which the breaker first halts the site temporarily, or None."""
    redis = FakeAsyncRedis()
    breaker = CircuitBreaker(redis)
    for second, statuses in enumerate(crawl_seconds(rate, error_share, seconds, seed)):
        record(redis, statuses, at=T0 + second)
        await breaker.check(T0 + second + 0.5)
        if "example" in redis.store.smembers(contracts.TEMP_HALTED):
            return second + 1
    return None


@pytest.mark.parametrize("rate", [1, 2, 5, 10, 25])
async def test_a_site_with_two_percent_errors_over_600_urls_is_never_halted(rate) -> None:
    assert [await halted_after(rate, 0.02, 600 // rate, seed) for seed in range(20)] == [None] * 20


@pytest.mark.parametrize("rate, seeds_halted", [(1, 14), (2, 20), (5, 20), (10, 20), (25, 20)])
async def test_a_site_with_fifteen_percent_errors_is_halted_within_the_minute(rate, seeds_halted) -> None:
    """15% of answers 500 (13% counted, a retry's second failure left out): from 5 req/s halted
    every time; at 1 req/s a minute's ~60 answers cannot tell it from a healthy site's bad minute
    as often (docs/decisions.md, "The breaker halts for errors, not chance"), the next minute can."""
    halts = [await halted_after(rate, 0.15, 120, seed) for seed in range(20)]
    assert sum(h is not None and h <= 60 for h in halts) >= seeds_halted
    assert None not in halts


@pytest.mark.parametrize("rate, within", [(1, 14), (2, 7), (5, 3), (10, 2), (25, 1)])
async def test_a_site_with_half_its_answers_failing_is_halted_within_seconds(rate, within) -> None:
    halts = [await halted_after(rate, 0.5, 60, seed) for seed in range(20)]
    assert all(h is not None and h <= within for h in halts), halts


async def test_a_temporary_halt_lifts_once_the_minute_no_longer_shows_the_surge(redis, capsys) -> None:
    breaker = CircuitBreaker(redis)
    record(redis, ["500"] * 10, at=T0)
    await breaker.check(T0 + 1)
    assert "example" in redis.store.smembers(contracts.TEMP_HALTED)
    record(redis, ["200"] * 100, at=T0 + 30)  # answers in flight when it halted: 10 of 110 is not a surge
    await breaker.check(T0 + 31)
    assert redis.store.smembers(contracts.TEMP_HALTED) == set()
    assert [(e["event"], e.get("type")) for e in logged(capsys)] == [
        ("crawl_halted", "temporary"), ("crawl_resumed", None)]


async def test_too_few_requests_to_judge_do_not_halt(redis) -> None:
    record(redis, ["Timeout"] * 9, at=T0 - 1)
    await CircuitBreaker(redis).check(T0)
    assert redis.store.smembers(contracts.TEMP_HALTED) == set()


async def test_expected_statuses_are_not_errors(redis) -> None:
    record(redis, ["404", "410", "301", "UnidentifiedImageError", "RobotsDisallowed"] * 10, at=T0 - 1)
    await CircuitBreaker(redis).check(T0)
    assert redis.store.smembers(contracts.TEMP_HALTED) == set() == redis.store.smembers(contracts.HALTED)


async def test_requests_older_than_a_minute_do_not_count_and_are_trimmed(redis) -> None:
    record(redis, ["500"] * 20, at=T0 - 61)
    record(redis, ["200"] * 20, at=T0 - 3601 - 60)       # a bucket that ended before the hour
    record(redis, ["404"] * 5, at=T0 - 13 * 3600)        # and one before the twelve hours
    await CircuitBreaker(redis).check(T0)
    assert redis.store.smembers(contracts.TEMP_HALTED) == set()
    assert redis.store.zrangebyscore(contracts.one_minute_window_key("example"), "-inf", "+inf") == []

    def counts(prefix: str) -> dict[str, int]:
        by_status: dict[str, int] = {}
        for field, n in redis.store.data[contracts.status_window_key(prefix, "example")].items():
            by_status[field.partition(":")[2]] = by_status.get(field.partition(":")[2], 0) + n
        return by_status
    assert counts("status1hr") == {"500": 20}
    assert counts("status12hr") == {"500": 20, "200": 20}


async def test_count_windows_hold_one_field_per_bucket_and_status_whatever_the_rate(redis) -> None:
    for second in range(600):
        record(redis, ["200"] * 5 + ["404"], at=T0 - 600 + second)
    await CircuitBreaker(redis).check(T0)
    hour = redis.store.data[contracts.status_window_key("status1hr", "example")]
    assert len(hour) <= 2 * 11 and sum(hour.values()) == 3600  # 10 minutes x 2 statuses, 3,600 requests


async def test_a_temporary_halt_clears_once_the_minute_is_clean(redis, capsys) -> None:
    breaker = CircuitBreaker(redis)
    record(redis, ["200"] * 10 + ["503"] * 10, at=T0)
    await breaker.check(T0 + 1)
    await breaker.check(T0 + 2)  # still bad: no second event
    assert "example" in redis.store.smembers(contracts.TEMP_HALTED)
    await breaker.check(T0 + 61)  # the errors have left the window
    assert redis.store.smembers(contracts.TEMP_HALTED) == set()
    assert [(e["event"], e.get("type")) for e in logged(capsys)] == [
        ("crawl_halted", "temporary"), ("crawl_resumed", None)]


@pytest.mark.parametrize("failures, halts", [(49, False), (50, True)])
async def test_fifty_failures_in_a_row_halt_permanently(redis, capsys, failures, halts) -> None:
    # Within the last minute, as any outcome a first check judges (no monitor, no tokens: none older is new).
    record(redis, ["200"] * (50 - failures), at=T0 - 30)
    record(redis, ["500"] * failures, at=T0 - 30)
    await CircuitBreaker(redis).check(T0)
    assert ("example" in redis.store.smembers(contracts.HALTED)) is halts
    permanent = [e for e in logged(capsys) if e.get("type") == "permanent"]
    assert len(permanent) == int(halts)
    if halts:
        assert set(permanent[0]) == {"event", "time", "type", "msg", "source"}
        assert permanent[0]["source"] == "example"


async def test_fewer_than_fifty_failures_on_record_do_not_halt(redis) -> None:
    record(redis, ["500"] * 49, at=T0 - 30)
    await CircuitBreaker(redis).check(T0)
    assert redis.store.smembers(contracts.HALTED) == set()


async def test_an_untrimmed_list_is_judged_on_its_newest_fifty(redis) -> None:
    redis.store.rpush(contracts.last_50_key("example"), "200", *["500"] * 50)  # a worker between RPUSH and LTRIM
    redis.store.zadd(contracts.ACTIVE_SOURCES, {"example": T0 - 1})
    await CircuitBreaker(redis).check(T0)
    assert redis.store.smembers(contracts.HALTED) == {"example"}


async def test_only_an_operator_lifts_a_permanent_halt(redis, capsys) -> None:
    breaker = CircuitBreaker(redis)
    record(redis, ["ServerDisconnected"] * 50, at=T0 - 3000)  # its minute long gone...
    redis.store.zadd(contracts.ACTIVE_SOURCES, {"example": T0 - 1})  # ... its last outcome kept out of it
    await breaker.check(T0)
    await breaker.check(T0 + 1)
    assert redis.store.smembers(contracts.HALTED) == {"example"}
    assert len(logged(capsys)) == 1  # one event per halt
    # The operator's procedure: clear the list, then release the source.
    redis.store.delete(contracts.last_50_key("example"))
    redis.store.srem(contracts.HALTED, "example")
    await breaker.check(T0 + 2)
    assert redis.store.smembers(contracts.HALTED) == set()


async def test_after_the_first_check_only_sources_with_recent_outcomes_are_read(redis) -> None:
    """Issue 20: the breaker's second reads the sources being crawled, not all it ever saw."""
    for n in range(500):
        redis.store.sadd(contracts.INBOUND_SOURCES, f"quiet{n}")
    breaker = CircuitBreaker(redis)
    await breaker.check(T0)  # every source, once
    record(redis, ["500"] * 50, at=T0 + 10)
    reads = []
    original = redis.store.zrangebyscore
    redis.store.zrangebyscore = lambda key, low, high, **kw: reads.append(key) or original(key, low, high, **kw)
    await breaker.check(T0 + 11)
    assert redis.store.smembers(contracts.HALTED) == {"example"}
    assert reads == [contracts.ACTIVE_SOURCES, contracts.one_minute_window_key("example")]


async def test_a_source_with_nothing_new_is_not_judged_again_within_the_clock_slack(redis) -> None:
    """Checks read ACTIVE_SOURCES_SLACK_SECONDS back for scores landing late: at 5,000 new sources
    every one was judged six times over, 43% of the monitor's loop (bench.sources)."""
    breaker = CircuitBreaker(redis)
    await breaker.check(T0)
    record(redis, ["200"] * 5, at=T0 + 10)
    reads = []
    original = redis.store.zrangebyscore
    redis.store.zrangebyscore = lambda key, low, high, **kw: reads.append(key) or original(key, low, high, **kw)
    await breaker.check(T0 + 11)
    assert reads == [contracts.ACTIVE_SOURCES, contracts.one_minute_window_key("example")]
    reads.clear()
    await breaker.check(T0 + 12)
    assert reads == [contracts.ACTIVE_SOURCES]
    record(redis, ["200"], at=T0 + 12)  # new activity: judged at the next check
    reads.clear()
    await breaker.check(T0 + 13)
    assert reads == [contracts.ACTIVE_SOURCES, contracts.one_minute_window_key("example")]


async def test_a_window_that_only_ages_into_a_surge_is_judged_within_a_full_pass(redis) -> None:
    """Successes leaving the minute before the errors do make a surge with no new outcome."""
    breaker = CircuitBreaker(redis)
    await breaker.check(T0)
    record(redis, ["200"] * 300, at=T0 + 1)
    record(redis, ["500"] * 25, at=T0 + 30)
    await breaker.check(T0 + 31)
    assert redis.store.smembers(contracts.TEMP_HALTED) == set()  # 25 of 325
    for second in range(62, 62 + int(BREAKER_FULL_PASS_SECONDS) + 1):
        await breaker.check(T0 + second)
    assert redis.store.smembers(contracts.TEMP_HALTED) == {"example"}  # 25 of 25


async def test_on_the_real_redis_the_window_is_trimmed_and_both_halts_read(redis_client, unique) -> None:
    """The breaker's read by script (READ_WINDOWS): the minute window trimmed, its last minute and
    the newest 50 statuses judged, as the fake Redis does."""
    import time
    now = time.time()
    surging, failing, healthy = (f"{unique}-{name}" for name in ("surging", "failing", "healthy"))
    for source, old, recent, last in ((surging, 50, ["200"] * 80 + ["500"] * 20, ["200"] * 60),
                                      (failing, 0, ["200"] * 5, ["200"] * 10 + ["503"] * 50),
                                      (healthy, 0, ["200"] * 99 + ["500"], ["500"] * 49 + ["200"])):
        await redis_client.zadd(contracts.ACTIVE_SOURCES, {source: now - 1})
        await redis_client.zadd(contracts.one_minute_window_key(source),
                                {f"500:old{n}": now - 61 for n in range(old)}
                                | {f"{status}:{n}": now - 30 for n, status in enumerate(recent)})
        await redis_client.rpush(contracts.last_50_key(source), *last)
    await CircuitBreaker(redis_client).check(now)
    assert await redis_client.zcard(contracts.one_minute_window_key(surging)) == 100  # the 50 old ones dropped
    assert await redis_client.smismember(contracts.TEMP_HALTED, [surging, failing, healthy]) == [1, 0, 0]
    assert await redis_client.smismember(contracts.HALTED, [surging, failing, healthy]) == [0, 1, 0]
