"""The token buckets (SPEC.md §3), driven tick by tick with a fake clock and a fake Redis."""
from __future__ import annotations

import asyncio
import json

import pytest

from common import contracts
from crawl_monitor.constants import (LIST_SIZES_REFRESH_SECONDS, MAX_RETRY_AFTER_SECONDS, RATE_LIMIT_REWRITE_SECONDS,
                                     RATE_LIMIT_TTL_SECONDS, REFILL_BATCH)
from crawl_monitor.periodic import every
from crawl_monitor.regulator import REFILL, Regulator, rate_due
from test.test_monitor_fakes import FakeAsyncRedis, RecordingStore

T0 = 1_800_000_000.0  # a fixed wall-clock second


def events(capsys, name: str) -> list[dict]:
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return [line for line in lines if line["event"] == name]


@pytest.fixture
def redis() -> FakeAsyncRedis:
    return FakeAsyncRedis()


def activate(redis: FakeAsyncRedis, *sources: str, at: float = T0 + 10**6) -> None:
    """As workers and the splitter score them in active_sources (by default: throughout a test)."""
    redis.store.sadd(contracts.INBOUND_SOURCES, *sources)
    redis.store.zadd(contracts.ACTIVE_SOURCES, dict.fromkeys(sources, at))


def regulator_with(redis: FakeAsyncRedis, **sizes: int) -> Regulator:
    regulator = Regulator(redis)
    regulator.set_sizes(sizes)
    if sizes:
        activate(redis, *sizes)
    return regulator


async def run_ticks(regulator: Regulator, source: str, seconds: int, start: float = T0) -> list[int]:
    return [(await regulator.tick(start + second))[source] for second in range(seconds)]


async def test_buckets_hold_the_computed_rate_and_expire_quickly(redis) -> None:
    regulator = regulator_with(redis, big=500_000_000, small=5_000, mid=250_002_500)
    grants = await regulator.tick(T0)
    assert grants == {"big": 200, "small": 1, "mid": 100}
    assert redis.store.get(contracts.tokens_key("big")) == "200"
    assert 1 < redis.store.expiry[contracts.tokens_key("big")] <= 2  # outlives one tick, not two
    assert float(redis.store.get(contracts.rate_limit_key("mid"))) == pytest.approx(100.5)
    assert regulator.rates["big"] == 200.0


async def test_half_a_request_per_second_is_one_token_every_two_seconds(redis) -> None:
    regulator = regulator_with(redis)
    await redis.set(contracts.override_rate_key("slow"), "0.5")
    activate(redis, "slow")
    seen = []
    for second in range(10):
        await regulator.tick(T0 + second)
        seen.append(redis.store.get(contracts.tokens_key("slow")))
    # The bucket is SET each second: the unused token of second 1 is gone in second 2, no burst.
    # Which of the two seconds gets it depends on the source's own phase (sources are spread out).
    assert seen in (["0", "1"] * 5, ["1", "0"] * 5)


async def test_slow_sources_get_their_tokens_in_different_seconds(redis) -> None:
    """100 sources at 0.5 req/s must not all be served in the same second (a worker would idle)."""
    regulator = regulator_with(redis)
    names = [f"slow{i}" for i in range(100)]
    for name in names:
        await redis.set(contracts.override_rate_key(name), "0.5")
        activate(redis, name)
    per_second = []
    for second in range(4):
        await regulator.tick(T0 + second)
        per_second.append(sum(int(redis.store.get(contracts.tokens_key(n))) for n in names))
    assert sum(per_second) == 200 and all(25 <= count <= 75 for count in per_second)


@pytest.mark.parametrize("rate, seconds, expected_total, max_per_second", [
    ("1.5", 10, 15, 2), ("0.2", 20, 4, 1), ("2.75", 4, 11, 3), ("0.1", 30, 3, 1), ("0", 5, 0, 0),
])
async def test_fractional_rates_carry_over_so_the_average_is_exact(
        redis, rate: str, seconds: int, expected_total: int, max_per_second: int) -> None:
    regulator = regulator_with(redis)
    await redis.set(contracts.override_rate_key("s"), rate)
    activate(redis, "s")
    grants = await run_ticks(regulator, "s", seconds)
    assert sum(grants) == expected_total and max(grants) == max_per_second


async def test_an_override_wins_and_its_removal_restores_the_computed_rate(redis) -> None:
    regulator = regulator_with(redis, example=5_000)
    assert (await regulator.tick(T0))["example"] == 1
    await redis.set(contracts.override_rate_key("example"), "5")
    assert (await regulator.tick(T0 + 1))["example"] == 5
    assert redis.store.get(contracts.rate_limit_key("example")) == "5.0"
    await redis.delete(contracts.override_rate_key("example"))
    assert (await regulator.tick(T0 + 2))["example"] == 1


@pytest.mark.parametrize("bad", ["fast", "", "-1", "nan", "inf", "5 req/s"])
async def test_an_unparsable_override_is_reported_once_and_ignored(redis, capsys, bad: str) -> None:
    regulator = regulator_with(redis, example=5_000)
    await redis.set(contracts.override_rate_key("example"), bad)
    assert await run_ticks(regulator, "example", 3) == [1, 1, 1]
    reported = events(capsys, "redis_value_ignored")
    assert len(reported) == 1 and reported[0]["source"] == "example"


async def test_halted_and_temp_halted_buckets_are_set_to_zero(redis) -> None:
    regulator = regulator_with(redis, a=500_000_000, b=500_000_000, c=500_000_000)
    await regulator.tick(T0)
    await redis.sadd(contracts.HALTED, "a")
    await redis.sadd(contracts.TEMP_HALTED, "b")
    await redis.set(contracts.override_rate_key("a"), "5")  # an override does not lift a halt
    grants = await regulator.tick(T0 + 1)
    assert grants == {"a": 0, "b": 0, "c": 200}
    assert redis.store.get(contracts.tokens_key("a")) == "0" == redis.store.get(contracts.tokens_key("b"))
    assert redis.store.expiry[contracts.tokens_key("a")] <= 2
    assert redis.store.get(contracts.rate_limit_key("a")) == "0.0"
    await redis.srem(contracts.HALTED, "a")
    assert (await regulator.tick(T0 + 2))["a"] == 5


async def test_a_source_with_urls_but_no_rate_gets_nothing_and_is_reported_now_and_then(redis, capsys) -> None:
    regulator = regulator_with(redis, known=5_000)
    activate(redis, "mystery", "known")
    for second in range(0, 299, 10):
        assert (await regulator.tick(T0 + second))["mystery"] == 0
    assert redis.store.get(contracts.tokens_key("mystery")) == "0"
    assert [e["source"] for e in events(capsys, contracts.EVENT_SOURCE_UNKNOWN)] == ["mystery"]
    await regulator.tick(T0 + 300)  # still unknown five minutes on: said again
    assert len(events(capsys, contracts.EVENT_SOURCE_UNKNOWN)) == 1
    await redis.set(contracts.override_rate_key("mystery"), "2")
    assert (await regulator.tick(T0 + 301))["mystery"] == 2
    await redis.delete(contracts.override_rate_key("mystery"))
    await regulator.tick(T0 + 302)  # unknown again: a new episode is reported at once
    assert len(events(capsys, contracts.EVENT_SOURCE_UNKNOWN)) == 1


async def test_retry_after_pauses_the_source_until_then_with_one_event(redis, capsys) -> None:
    regulator = regulator_with(redis, example=500_000_000)
    await redis.set(contracts.retry_after_key("example"), str(T0 + 30))
    grants = [(await regulator.tick(T0 + second))["example"] for second in range(0, 40, 5)]
    assert grants == [0, 0, 0, 0, 0, 0, 200, 200]
    paused = events(capsys, contracts.EVENT_RETRY_AFTER)
    assert len(paused) == 1 and paused[0]["source"] == "example" and paused[0]["until"]


async def test_retry_after_is_capped_at_an_hour(redis) -> None:
    regulator = regulator_with(redis, example=500_000_000)
    await redis.set(contracts.retry_after_key("example"), str(T0 + 365 * 86400))
    assert (await regulator.tick(T0))["example"] == 0
    assert (await regulator.tick(T0 + MAX_RETRY_AFTER_SECONDS - 1))["example"] == 0
    assert (await regulator.tick(T0 + MAX_RETRY_AFTER_SECONDS))["example"] == 200


async def test_a_new_retry_after_while_paused_extends_without_a_second_event(redis, capsys) -> None:
    regulator = regulator_with(redis, example=500_000_000)
    await redis.set(contracts.retry_after_key("example"), str(T0 + 10))
    await regulator.tick(T0)
    await redis.set(contracts.retry_after_key("example"), str(T0 + 20))
    assert (await regulator.tick(T0 + 5))["example"] == 0
    assert (await regulator.tick(T0 + 15))["example"] == 0
    assert (await regulator.tick(T0 + 20))["example"] == 200
    assert len(events(capsys, contracts.EVENT_RETRY_AFTER)) == 1
    await redis.set(contracts.retry_after_key("example"), "soon")  # garbage: ignored, reported
    assert (await regulator.tick(T0 + 21))["example"] == 200
    assert len(events(capsys, "redis_value_ignored")) == 1


async def test_a_clean_stop_empties_the_buckets(redis) -> None:
    regulator = regulator_with(redis, example=500_000_000)
    await regulator.tick(T0)
    await regulator.empty_buckets()
    assert await redis.decr(contracts.tokens_key("example")) == -1  # fail closed
    assert redis.store.get(contracts.rate_limit_key("example")) is None


async def test_no_sources_no_writes(redis) -> None:
    assert await Regulator(redis).tick(T0) == {}
    assert redis.store.data == {}


async def test_the_tick_loop_outlives_a_failing_tick(capsys) -> None:
    calls = []

    async def step() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("Redis is away")

    task = asyncio.create_task(every(0.01, step, "regulator"))
    while len(calls) < 3:
        await asyncio.sleep(0.01)
    task.cancel()
    errors = events(capsys, "monitor_component_error")
    assert len(errors) == 1 and errors[0]["component"] == "regulator" and "Redis is away" in errors[0]["error"]


async def test_thousands_of_buckets_are_written_in_bounded_batches() -> None:
    """Issue 20: one pipeline of every source's SETs held Redis for its whole length each second,
    and a SET a key through redis-py was a quarter of the monitor's CPU: one script call a batch."""
    sizes: list[int] = []
    redis = FakeAsyncRedis()
    refill = redis.register_script(REFILL)

    async def counting(keys: list[str], args: list) -> int:
        sizes.append(len(keys))
        return await refill(keys=keys, args=args)
    redis.register_script = lambda script: counting  # type: ignore[method-assign]
    regulator = regulator_with(redis, **{f"s{n:04d}": 500_000_000 for n in range(1200)})
    grants = await regulator.tick(T0)
    assert len(grants) == 1200 and all(redis.store.get(contracts.tokens_key(s)) == "200" for s in grants)
    assert sum(sizes) == 2 * 1200 and max(sizes) <= 2 * REFILL_BATCH


async def test_at_100000_sources_a_second_reads_and_writes_only_the_active_ones() -> None:
    """Issue 26: 100,000 sources seen (a day's crawl, some halted, all in the sources list) and 50
    being crawled: one second of the regulator, the adaptive back-off and the breaker touches
    those 50 and the global keys, nothing of the others."""
    from crawl_monitor.adaptive import Adaptation
    from crawl_monitor.circuit_breaker import CircuitBreaker
    from test.test_monitor_fakes import RecordingStore
    store = RecordingStore()
    quiet = [f"quiet{n:06d}" for n in range(100_000)]
    busy = [f"busy{n:03d}" for n in range(50)]
    store.data[contracts.INBOUND_SOURCES] = set(quiet) | set(busy)
    store.data[contracts.ACTIVE_SOURCES] = {s: T0 - 7200 - n / 100 for n, s in enumerate(quiet)}
    store.data[contracts.HALTED] = set(quiet[:1000]) | set(busy[:2])
    for n, source in enumerate(busy):
        store.zadd(contracts.ACTIVE_SOURCES, {source: T0 - n / 100})
        store.rpush(contracts.last_50_key(source), *["200"] * 50)
    redis = FakeAsyncRedis(store)
    now = [T0]
    adaptation = Adaptation(redis, clock=lambda: now[0])
    regulator = Regulator(redis, adaptation)
    regulator.set_sizes(dict.fromkeys(quiet + busy, 500_000_000))
    breaker = CircuitBreaker(redis)
    for second in range(3):  # the first second of a monitor, then two more
        now[0] = T0 + second
        store.commands.clear()
        grants = await regulator.tick(now[0])
        await adaptation.update()
        await breaker.check(now[0])
        assert set(grants) == set(busy) and grants[busy[0]] == 0 and grants[busy[2]] == 20  # slow start
        assert not any(name.startswith("quiet") or ":quiet" in name for name in store.names())
        assert store.items_read() < 100 * len(busy), store.items_read()  # each one's last 50 and a few more
        written = {args[0] for name, args, _ in store.commands if name in ("set", "hset", "sadd", "srem")}
        assert written <= {key for s in busy for key in (contracts.tokens_key(s), contracts.rate_limit_key(s),
                                                         contracts.adaptive_key(s))}
    assert len(regulator.rates) == 50 and len(adaptation.controllers) == 48  # the halted two get no verdict


async def test_a_site_of_a_url_list_is_rated_by_its_count_there(redis, capsys) -> None:
    """Issue 27: the list producer's counts in list_source_sizes, read the first second a source has
    URLs and again every LIST_SIZES_REFRESH_SECONDS; SOURCES_URL and an override win over them."""
    regulator = regulator_with(redis, flickr=500_000_000)
    await redis.zadd(contracts.ACTIVE_SOURCES, dict.fromkeys(
        ("site1.co.uk", "big.example", "flickr", "nowhere.example"), T0))  # split: they have URLs
    await redis.hincrby(contracts.LIST_SOURCE_SIZES, "site1.co.uk", 30)
    await redis.hincrby(contracts.LIST_SOURCE_SIZES, "big.example", 250_002_500)
    await redis.hincrby(contracts.LIST_SOURCE_SIZES, "flickr", 10)       # SOURCES_URL's size wins
    grants = await regulator.tick(T0)
    assert [grants[s] for s in ("site1.co.uk", "big.example", "flickr", "nowhere.example")] == [1, 100, 200, 0]
    assert [e["source"] for e in events(capsys, contracts.EVENT_SOURCE_UNKNOWN)] == ["nowhere.example"]
    await redis.set(contracts.override_rate_key("big.example"), "7")
    await redis.hincrby(contracts.LIST_SOURCE_SIZES, "site1.co.uk", 250_002_470)  # the list grows
    assert (await regulator.tick(T0 + 1))["big.example"] == 7
    assert regulator.rates["site1.co.uk"] == 1.0                          # not re-read yet
    await redis.zadd(contracts.ACTIVE_SOURCES, {"site1.co.uk": T0 + LIST_SIZES_REFRESH_SECONDS - 1})  # still waits
    await regulator.tick(T0 + LIST_SIZES_REFRESH_SECONDS)
    assert regulator.rates["site1.co.uk"] == pytest.approx(100.5)


async def test_a_default_rate_crawls_a_source_with_no_size_at_all(redis, capsys) -> None:
    regulator = Regulator(redis, default_rate=2.5)
    await redis.zadd(contracts.ACTIVE_SOURCES, {"nowhere.example": T0})
    assert [(await regulator.tick(T0 + s))["nowhere.example"] for s in range(4)] in ([2, 3, 2, 3], [3, 2, 3, 2])
    assert not events(capsys, contracts.EVENT_SOURCE_UNKNOWN)


@pytest.mark.parametrize("kind, limit, sources, cap", [
    ("list", 1.0, "lists", 32.0), ("default", 2.5, "lists", 32.0), ("catalog", 1.0, "lists", None),
    ("catalog", 1.0, "all", 32.0), ("override", 1.0, "all", None), ("list", 1.0, "none", None),
    ("list", 100.0, "lists", 100.0),  # a limit above the ceiling is never lowered by it
])
def test_which_sources_may_discover_and_up_to_what(kind, limit, sources, cap) -> None:
    from crawl_monitor.regulator import discovery_cap
    assert discovery_cap(kind, limit, sources, 32.0) == cap


async def test_a_list_site_is_granted_what_it_discovers_and_an_override_pins_it(redis) -> None:
    """Capacity discovery: a list site (and, with DISCOVERY_SOURCES=all, a catalog one) may be
    granted past its size's rate up to DISCOVERY_MAX_RATE; an override and a catalog site keep theirs."""
    from crawl_monitor.adaptive import Adaptation, Controller
    adaptation = Adaptation(redis, clock=lambda: T0)
    regulator = Regulator(redis, adaptation, discovery_max_rate=32.0, discovery_sources="lists")
    regulator.set_sizes({"catalog.example": 5_000})
    await redis.hincrby(contracts.LIST_SOURCE_SIZES, "list.example", 30)
    await redis.hincrby(contracts.LIST_SOURCE_SIZES, "pinned.example", 30)
    await redis.set(contracts.override_rate_key("pinned.example"), "3")
    activate(redis, "catalog.example", "list.example", "pinned.example")
    assert regulator.limit_of("list.example") == 32.0  # spread for the ceiling before its first tick
    assert regulator.limit_of("catalog.example") == 1.0
    await regulator.tick(T0)
    assert regulator.rates == {"catalog.example": 1.0, "list.example": 6.4, "pinned.example": 1.0}  # a fifth of 32
    for source in regulator.rates:  # as if each had answered fast at every doubling
        adaptation.controllers[source] = Controller(multiplier=50.0, slow_start=False)
    grants = await regulator.tick(T0 + 1)
    assert grants == {"catalog.example": 1, "list.example": 32, "pinned.example": 3}
    assert redis.store.get(contracts.rate_limit_key("list.example")) == "32.0"  # what the workers pace by
    assert (regulator.limit_of("list.example"), regulator.limit_of("pinned.example")) == (32.0, 3.0)
    assert contracts.url_shards(regulator.limit_of("list.example")) == 2
    await adaptation.update()
    saved = redis.store.hgetall(contracts.adaptive_key("list.example"))
    assert (saved["limit"], saved["ceiling"], saved["effective_rate"]) == ("1", "32", "32")


@pytest.mark.parametrize("rate, written, now, due", [
    (5.0, None, T0, True),                                          # new to this regulator
    (5.0, (5.0, T0), T0 + 1, False),                                # unchanged, written a second ago
    (10.0, (5.0, T0), T0 + 1, True),                                # changed
    (5.0, (5.0, T0), T0 + RATE_LIMIT_REWRITE_SECONDS - 0.01, False),
    (5.0, (5.0, T0), T0 + RATE_LIMIT_REWRITE_SECONDS, True),        # half its life gone: again
    (0.0, (5.0, T0), T0 + 1, True),                                 # halted
])
def test_a_rate_is_written_when_it_changes_and_before_it_expires(rate, written, now, due) -> None:
    assert rate_due(rate, written, now) is due
    assert RATE_LIMIT_REWRITE_SECONDS < RATE_LIMIT_TTL_SECONDS


async def test_a_source_ticked_at_one_rate_has_its_rate_written_twice_in_ten_seconds() -> None:
    """Issue 44: a one-URL site is ticked ~5 times at one rate, and each tick wrote its rate_limit
    (a SET a tick, ~5 of ~62 Redis commands a URL in bench.fleet). Its bucket is still set every
    tick; its rate when it changes, and every RATE_LIMIT_REWRITE_SECONDS of its 10 s of life."""
    store = RecordingStore()
    redis = FakeAsyncRedis(store)
    regulator = regulator_with(redis, example=500_000_000)
    assert await run_ticks(regulator, "example", 10) == [200] * 10
    sets = [args[0] for name, args, _ in store.commands if name == "set"]
    assert sets.count(contracts.tokens_key("example")) == 10
    assert sets.count(contracts.rate_limit_key("example")) == 2
    assert store.expiry[contracts.rate_limit_key("example")] == RATE_LIMIT_TTL_SECONDS
    await redis.set(contracts.override_rate_key("example"), 7)  # the operator's override: written at once
    store.commands.clear()
    assert (await regulator.tick(T0 + 10))["example"] == 7
    assert store.get(contracts.rate_limit_key("example")) == "7.0"


async def test_after_redis_lost_its_data_every_rate_is_written_at_the_next_tick() -> None:
    """A bucket without its rate_limit would be spent unpaced by a worker new to the source: once
    the lease finds Redis emptied (``MonitorLease.on_emptied``), the next tick writes every rate,
    changed or not, and the back-off's states are saved whole again."""
    store = RecordingStore()
    redis = FakeAsyncRedis(store)
    regulator = regulator_with(redis, example=500_000_000)
    await run_ticks(regulator, "example", 2)
    store.data.clear()  # Redis restarted empty
    store.expiry.clear()
    activate(redis, "example")
    await regulator.tick(T0 + 2)
    assert store.get(contracts.rate_limit_key("example")) is None  # not due: written 2 s ago, as far as it knows
    regulator.forget_written()
    await regulator.tick(T0 + 3)
    assert store.get(contracts.rate_limit_key("example")) == "200.0"
