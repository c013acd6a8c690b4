"""The monitoring_update line (SPEC.md §4): its exact shape, and rates over the interval."""
from __future__ import annotations

import json
import time

from common import contracts
from crawl_monitor.constants import MONITORING_MAX_LISTED
from crawl_monitor.monitoring import MonitoringLog
from test.test_monitor_fakes import FakeAsyncRedis, FakeStore, RecordingStore

GENERAL = {"global_max_rps", "error_rps", "processing_rate", "success_rps", "circuit_breaker_tripped",
           "num_resized", "resize_errors", "split_rate", "sources_total", "sources_listed", "sources_stopped",
           "opted_out"}
SPECIFIC = {"successful", "error", "last_50_statuses", "rate_limit", "limit", "ceiling", "effective_rate",
            "response_ms", "backlog", "opted_out"}
MAX_LINE_BYTES = 256 * 1024  # issue 26: one line stays under 256 KiB


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
    store.hset(contracts.adaptive_key("flickr"), mapping={"effective_rate": "178.5", "limit": "2", "ceiling": "178.5",
                                                          "baseline_ms": "210.5", "recent_ms": "250"})
    store.set(contracts.errors_key("phylopic"), 7)
    store.set(contracts.urls_split_key("flickr"), 100)
    store.set(contracts.urls_ended_key("flickr"), 58)
    store.hincrby(contracts.opted_out_key("flickr"), "tdmrep-file", 3)
    store.hincrby(contracts.opted_out_key("flickr"), "x-robots-tag", 1)
    store.hincrby(contracts.OPTED_OUT, "tdmrep-file", 3)
    store.hincrby(contracts.OPTED_OUT, "x-robots-tag", 1)
    store.zadd(contracts.ACTIVE_SOURCES, {"flickr": time.time()})  # crawled now; phylopic and met are stopped
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
        "split_rate": 1_000.0, "sources_total": 2, "sources_listed": 3, "sources_stopped": 2,
        "opted_out": {"tdmrep-file": 3, "x-robots-tag": 1},
    }
    assert set(update["specific"]) == {"flickr", "phylopic", "met"}  # active or stopped
    assert all(set(entry) == SPECIFIC for entry in update["specific"].values())
    assert update["specific"]["flickr"] == {
        "successful": 40, "error": 0, "last_50_statuses": {"200": 48, "404": 1, "500": 1}, "rate_limit": 178.5,
        "limit": 2.0, "ceiling": 178.5, "effective_rate": 178.5, "response_ms": {"baseline": 210.5, "recent": 250.0},
        "backlog": 42, "opted_out": {"tdmrep-file": 3, "x-robots-tag": 1}}
    assert update["specific"]["phylopic"]["error"] == 7 and update["specific"]["phylopic"]["opted_out"] == {}
    # Before the adaptive back-off's first verdict on a source: no numbers, the same keys.
    assert update["specific"]["phylopic"]["effective_rate"] is None is update["specific"]["phylopic"]["ceiling"]
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


def crawl_of(store: FakeStore, quiet: int, active: int, now: float) -> None:
    """``quiet`` sources seen hours ago, with counters and their last state, and ``active`` ones
    being crawled now; a few of the quiet ones halted long ago, which a line still lists."""
    data, names = store.data, [f"quiet{n:06d}" for n in range(quiet)]
    data[contracts.INBOUND_SOURCES] = set(names) | {f"busy{n:03d}" for n in range(active)}
    data[contracts.ACTIVE_SOURCES] = {source: now - 7200 - n / 100 for n, source in enumerate(names)}
    data.update(dict.fromkeys(map(contracts.resized_key, names), "10"))
    data.update(dict.fromkeys(map(contracts.urls_split_key, names), "10"))
    data[contracts.HALTED] = set(names[:3])
    for n in range(active):
        source = f"busy{n:03d}"
        store.zadd(contracts.ACTIVE_SOURCES, {source: now - n / 100})
        store.set(contracts.rate_limit_key(source), 2.0)
        store.set(contracts.resized_key(source), 7)
        store.set(contracts.urls_split_key(source), 100)
        store.set(contracts.urls_ended_key(source), 7)
        store.rpush(contracts.last_50_key(source), *(["200"] * 45 + ["404"] * 5))


async def test_at_100000_sources_a_line_reads_and_lists_only_the_active_and_stopped_ones(capsys) -> None:
    """Issue 26: 100,000 sources seen, 50 being crawled: the line reads and names those 50 (and the 3
    halted), counts the rest, and stays far under 256 KiB."""
    store = RecordingStore()
    clock, wall = Clock(), Clock()
    wall.now = 1_800_000_000.0
    crawl_of(store, quiet=100_000, active=50, now=wall.now)
    monitoring = MonitoringLog(FakeAsyncRedis(store), clock=clock, wall_clock=wall)
    store.commands.clear()
    update = await monitoring.update()
    line = capsys.readouterr().out.splitlines()[-1]
    assert len(line.encode()) < 20 * 1024, len(line)
    assert update["general"]["sources_total"] == 100_050 and update["general"]["sources_listed"] == 53
    assert set(update["specific"]) == {f"busy{n:03d}" for n in range(50)} | {"quiet000000", "quiet000001",
                                                                              "quiet000002"}
    assert update["specific"]["busy000"]["backlog"] == 93 and update["specific"]["quiet000001"]["backlog"] == 10
    assert update["general"]["global_max_rps"] == 100.0
    named = {name for name in store.names() if "quiet" in name}
    assert named <= {key for n in range(3) for key in _keys_of(f"quiet{n:06d}")}  # the halted ones only
    assert store.items_read() < 60 * 53, store.items_read()  # its last 50 and a few more a listed source
    assert len(store.commands) < 10 * 53


def _keys_of(source: str) -> set[str]:
    return {source, contracts.rate_limit_key(source), contracts.urls_split_key(source),
            contracts.urls_ended_key(source), contracts.resized_key(source), contracts.errors_key(source),
            contracts.last_50_key(source), contracts.adaptive_key(source), contracts.opted_out_key(source)}


async def test_a_line_stays_under_256_kib_however_many_sources_are_active_or_halted(capsys) -> None:
    """The worst a crawl can make of one line: thousands of sources active in one interval, with
    the longest names and many statuses each, and thousands halted: it lists what fits, halted
    first, and counts the rest."""
    store = FakeStore()
    wall = Clock()
    wall.now = 1_800_000_000.0
    long = "x" * 190
    statuses = [str(code) for code in range(400, 440)] + ["UnidentifiedImageError", "ServerDisconnected"]
    for n in range(3_000):
        source = f"{long}{n:06d}"
        store.sadd(contracts.INBOUND_SOURCES, source)
        store.zadd(contracts.ACTIVE_SOURCES, {source: wall.now - 1})
        store.rpush(contracts.last_50_key(source), *statuses)
        store.set(contracts.rate_limit_key(source), 1.0)
        if n % 2:
            store.sadd(contracts.HALTED, source)
    monitoring = MonitoringLog(FakeAsyncRedis(store), clock=Clock(), wall_clock=wall)
    update = await monitoring.update()
    line = capsys.readouterr().out.splitlines()[-1]
    assert len(line.encode()) < MAX_LINE_BYTES, len(line)
    general = update["general"]
    assert 50 < general["sources_listed"] < MONITORING_MAX_LISTED and general["sources_total"] == 3_000
    assert all(int(source[-6:]) % 2 for source in update["specific"])  # the halted ones come first
    assert general["sources_stopped"] == 1_500 and 100 < len(general["circuit_breaker_tripped"]) < 1_500
    assert general["global_max_rps"] == 3_000.0  # summed over every source granted a rate, listed or not


async def test_a_quiet_source_leaves_the_line_and_comes_back_with_its_next_outcome(capsys) -> None:
    redis, clock, wall = FakeAsyncRedis(), Clock(), Clock()
    store = redis.store
    store.sadd(contracts.INBOUND_SOURCES, "busy", "quiet")
    for source in ("busy", "quiet"):
        store.set(contracts.resized_key(source), 7)
        store.zadd(contracts.ACTIVE_SOURCES, {source: wall.now - 1})
    monitoring = MonitoringLog(redis, clock=clock, wall_clock=wall)
    assert set((await monitoring.update())["specific"]) == {"busy", "quiet"}
    for _ in range(2):  # the next line too: a worker's score may land a moment after its time
        clock.now += 5
        wall.now += 5
        store.zadd(contracts.ACTIVE_SOURCES, {"busy": wall.now - 1})
        update = await monitoring.update()
    assert set(update["specific"]) == {"busy"}
    assert (update["general"]["sources_total"], update["general"]["sources_listed"]) == (2, 1)
    clock.now += 5
    wall.now += 5
    store.zadd(contracts.ACTIVE_SOURCES, {"quiet": wall.now - 1})
    assert set((await monitoring.update())["specific"]) == {"busy", "quiet"}
