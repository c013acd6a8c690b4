"""The monitoring_update line (SPEC.md §4): its exact shape, and rates over the interval."""
from __future__ import annotations

import json

from common import contracts
from crawl_monitor.monitoring import MonitoringLog
from test.test_monitor_fakes import FakeAsyncRedis

GENERAL = {"global_max_rps", "error_rps", "processing_rate", "success_rps", "circuit_breaker_tripped",
           "num_resized", "resize_errors", "split_rate"}
SPECIFIC = {"successful", "error", "last_50_statuses", "rate_limit", "effective_rate", "response_ms"}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def seed(store, resized: int, errors: int, split: int) -> None:
    store.set(contracts.NUM_RESIZED, resized)
    store.set(contracts.RESIZE_ERRORS, errors)
    store.set(contracts.NUM_SPLIT, split)


async def test_update_has_exactly_the_spec_fields_and_rates_over_the_interval(capsys) -> None:
    redis, clock = FakeAsyncRedis(), Clock()
    store = redis.store
    store.sadd(contracts.INBOUND_SOURCES, "flickr", "phylopic")
    store.sadd(contracts.HALTED, "phylopic")
    store.sadd(contracts.TEMP_HALTED, "met")
    store.set(contracts.rate_limit_key("flickr"), 178.5)
    store.set(contracts.rate_limit_key("phylopic"), 0.0)
    store.set(contracts.resized_key("flickr"), 40)
    store.hset(contracts.adaptive_key("flickr"), mapping={"effective_rate": "178.5", "ceiling": "178.5",
                                                          "baseline_ms": "210.5", "recent_ms": "250"})
    store.set(contracts.errors_key("phylopic"), 7)
    store.rpush(contracts.last_50_key("flickr"), *(["200"] * 48 + ["404", "500"]))
    seed(store, resized=1_000, errors=10, split=5_000)
    monitoring = MonitoringLog(redis, clock=clock)
    first = await monitoring.update()
    assert first["general"]["success_rps"] == 0 and first["general"]["split_rate"] == 0

    clock.now += 5
    seed(store, resized=1_050, errors=20, split=10_000)
    update = await monitoring.update()
    assert set(update) == {"event", "time", "general", "specific"}
    assert update["event"] == "monitoring_update"
    assert set(update["general"]) == GENERAL
    assert update["general"] == {
        "global_max_rps": 178.5, "error_rps": 2.0, "processing_rate": 12.0, "success_rps": 10.0,
        "circuit_breaker_tripped": ["met", "phylopic"], "num_resized": 1_050, "resize_errors": 20,
        "split_rate": 1_000.0,
    }
    assert set(update["specific"]) == {"flickr", "phylopic"}
    assert all(set(entry) == SPECIFIC for entry in update["specific"].values())
    assert update["specific"]["flickr"] == {
        "successful": 40, "error": 0, "last_50_statuses": {"200": 48, "404": 1, "500": 1}, "rate_limit": 178.5,
        "effective_rate": 178.5, "response_ms": {"baseline": 210.5, "recent": 250.0}}
    assert update["specific"]["phylopic"]["error"] == 7
    # Before the adaptive back-off's first verdict on a source: no numbers, the same keys.
    assert update["specific"]["phylopic"]["effective_rate"] is None
    assert update["specific"]["phylopic"]["response_ms"] == {"baseline": None, "recent": None}
    assert monitoring.latest is update
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and json.loads(lines[1]) == json.loads(json.dumps(update))


async def test_a_counter_that_went_down_gives_zero_not_a_negative_rate() -> None:
    redis, clock = FakeAsyncRedis(), Clock()
    seed(redis.store, resized=500, errors=5, split=500)
    monitoring = MonitoringLog(redis, clock=clock)
    await monitoring.update()
    redis.store.data.clear()
    clock.now += 5
    update = await monitoring.update()
    assert update["general"]["success_rps"] == 0 and update["general"]["num_resized"] == 0
    assert update["specific"] == {} and update["general"]["global_max_rps"] == 0


async def test_quiet_sources_are_reread_once_a_minute_active_ones_every_update(capsys) -> None:
    """Issue 20: the counters of 5,000 sources every 5 s were a sixth of the monitor's time."""
    redis, clock, wall = FakeAsyncRedis(), Clock(), Clock()
    store = redis.store
    store.sadd(contracts.INBOUND_SOURCES, "busy", "quiet")
    monitoring = MonitoringLog(redis, clock=clock, wall_clock=wall)
    await monitoring.update()
    for source in ("busy", "quiet"):
        store.set(contracts.resized_key(source), 7)
        store.set(contracts.rate_limit_key(source), 2.0)
    store.zadd(contracts.ACTIVE_SOURCES, {"busy": wall.now + 1})
    clock.now += 5
    wall.now += 5
    specific = (await monitoring.update())["specific"]
    assert (specific["busy"]["successful"], specific["quiet"]["successful"]) == (7, 0)
    assert specific["quiet"]["rate_limit"] == 2.0  # the limits are read for every source each time
    clock.now += 60
    wall.now += 60
    assert (await monitoring.update())["specific"]["quiet"]["successful"] == 7
