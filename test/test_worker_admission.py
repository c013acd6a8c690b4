"""Fast sources first while a worker is short of CPU (worker.scheduling.slow_starts), and what the scheduler
does with it: slow sources' starts held to the allowance, the partitions that feed a fast source
kept open near the memory bound and its URLs taken past it, a source read before its rate waits a
short turn."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from common.contracts import URLS_TOPIC, CrawlRequest, rate_limit_key
from test.test_worker_scheduler import make, never_ends, parked, records, redis_with, run_until, until
from test.worker_fakes import FakeFeed, FakeProducer
from worker.intake import read_ahead as read_ahead_module
from worker.scheduling import scheduler as scheduler_module
from worker.monitor_view import MonitorView
from worker.constants import REALLOCATE_INTERVAL
from worker.scheduling import sizing
from worker.scheduling.slow_starts import Admission
from worker.constants import (LOOP_LAG_TARGET, PARK_DEFAULT_SECONDS, PARK_UNJUDGED_SECONDS, SLOW_SHARE,
                              SLOW_STARTS_DECREASE, SLOW_STARTS_FLOOR)

Handler = Callable[[CrawlRequest], Awaitable[float]]
pytestmark = pytest.mark.paced  # runs by itself, after the rest (pytest.ini)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def second(admission: Admission, clock: Clock, lag: float, slow_starts: int, fast_working: bool = True,
           slow_demand: float = 2500.0, ended: int = 0) -> None:
    """One second of the loop: ``slow_starts`` slow starts where allowed, probes at ``lag``."""
    for _ in range(slow_starts):
        if admission.may_start_slow():
            admission.started_slow()
    for _ in range(ended):
        admission.ended()
    for _ in range(50):
        admission.lagged(lag)
    clock.now += 1.0
    admission.update(fast_working, slow_demand)


def test_nothing_is_limited_while_no_fast_source_works_however_late_the_loop() -> None:
    clock = Clock()
    admission = Admission(clock)
    for _ in range(5):
        second(admission, clock, lag=0.2, slow_starts=300, fast_working=False)
    assert admission.limit is None and admission.may_start_slow()


def test_a_late_loop_cuts_the_slow_starts_to_a_floor_and_a_prompt_one_lets_them_climb() -> None:
    clock = Clock()
    admission = Admission(clock)
    second(admission, clock, lag=LOOP_LAG_TARGET * 4, slow_starts=200)
    assert admission.limit == 200 * SLOW_STARTS_DECREASE  # from what was started
    limits = []
    for _ in range(30):
        second(admission, clock, lag=LOOP_LAG_TARGET * 4, slow_starts=200)
        limits.append(admission.limit)
    assert limits == sorted(limits, reverse=True) and limits[-1] == SLOW_STARTS_FLOOR  # never starved
    second(admission, clock, lag=LOOP_LAG_TARGET * 4, slow_starts=200)
    assert admission.limit == SLOW_STARTS_FLOOR  # the allowance, not the asking, decides: at most the floor a second
    climbing = []
    for _ in range(10):
        second(admission, clock, lag=LOOP_LAG_TARGET / 4, slow_starts=200)
        climbing.append(admission.limit)
    assert climbing == sorted(climbing) and climbing[-1] > 3 * SLOW_STARTS_FLOOR
    second(admission, clock, lag=LOOP_LAG_TARGET / 4, slow_starts=200, fast_working=False)
    assert admission.limit is None


def test_slow_sources_keep_what_they_ask_up_to_a_share_of_the_worker() -> None:
    """A few slow sources beside fast ones (the demo's 1-3 req/s sites) are not held at all;
    thousands keep SLOW_SHARE of what the worker ends a second."""
    few_clock, many_clock = Clock(), Clock()
    few, many = Admission(few_clock), Admission(many_clock)
    for _ in range(20):
        second(few, few_clock, lag=LOOP_LAG_TARGET * 4, slow_starts=6, slow_demand=6.0, ended=100)
        second(many, many_clock, lag=LOOP_LAG_TARGET * 4, slow_starts=300, slow_demand=2500.0, ended=100)
    assert few.limit == 6.0
    assert many.limit == SLOW_SHARE * 100


def test_the_allowance_holds_slow_starts_to_the_limit() -> None:
    clock = Clock()
    admission = Admission(clock)
    admission.limit = 20.0
    started = 0
    for _ in range(100):  # 1 s in steps of 10 ms, asking each time
        clock.now += 0.01
        while admission.may_start_slow():
            admission.started_slow()
            started += 1
    assert 18 <= started <= 21


def held_slow_starts() -> Admission:
    """Slow sources' starts held at the floor, as a late loop would hold them."""
    admission = Admission()
    admission.limit = SLOW_STARTS_FLOOR
    admission.update = lambda fast_working, slow_demand: None  # type: ignore[method-assign]
    return admission


async def test_probe_measures_the_loops_delay() -> None:
    admission = Admission()
    probe = asyncio.create_task(admission.probe_forever())
    await asyncio.sleep(0.1)
    time.sleep(0.05)  # the loop blocked: the next probe runs late
    await asyncio.sleep(0.05)
    probe.cancel()
    samples, total = admission.probed()
    assert samples >= 2 and total >= 0.03


async def test_a_fast_source_starts_beside_slow_ones_held_to_their_allowance(monkeypatch) -> None:
    monkeypatch.setattr(scheduler_module, "REFRESH_INTERVAL", 0.05)
    slow = [r for n in range(200) for r in records(f"slow{n}", 1, first_offset=n)]
    feed = FakeFeed(slow + records("fast", 100, first_offset=200), batch_size=500)
    redis = await redis_with({"fast": 100.0} | {f"slow{n}": 0.5 for n in range(200)})
    started: list[str] = []

    async def handle(request: CrawlRequest) -> float:
        started.append(request.source)
        await asyncio.sleep(60)
        return 0.0

    scheduler = make(feed, redis, handle, max_tasks=500, admission=held_slow_starts())  # short of CPU
    await run_until(scheduler, lambda: started.count("fast") >= 20, timeout=5)
    slow_started = len(started) - started.count("fast")
    assert slow_started <= 2 + 2 * SLOW_STARTS_FLOOR, slow_started  # before the limit, then its allowance


async def test_near_the_bound_the_partitions_feeding_a_fast_source_stay_open(monkeypatch) -> None:
    monkeypatch.setattr(scheduler_module, "REFRESH_INTERVAL", 0.05)
    slow = [r for n in range(90) for r in records(f"slow{n}", 1, partition=n % 3, first_offset=n)]
    feed = FakeFeed(records("fast", 1, partition=3) + slow, batch_size=10)
    redis = await redis_with({"fast": 100.0} | {f"slow{n}": 0.5 for n in range(90)})
    view = MonitorView()
    scheduler = make(feed, redis, never_ends, max_tasks=5, max_queued=100, view=view)
    runner = asyncio.create_task(scheduler.run())
    try:
        await until(lambda: view.rate("fast") == 100.0 and scheduler.load().waiting >= 75)
        await asyncio.sleep(REALLOCATE_INTERVAL + 0.05)  # a pass over the sources: it is known as fast
        assert not feed.paused  # no fast source's partition known yet: the bound alone pauses
        feed.records.extend(records("fast", 2, partition=3, first_offset=1))  # back from a wait, say
        await until(lambda: len(feed.paused) == 3)
        assert (URLS_TOPIC, 3) not in feed.paused  # the fast source's URLs still come in
    finally:
        scheduler.stop()
        await runner


async def test_past_the_bound_a_fast_sources_urls_behind_slow_ones_are_taken_and_the_slow_ones_left(
        monkeypatch) -> None:
    """At MAX_QUEUED_URLS (less FAST_ROOM of it) the worker reads on: the fast source's URLs behind
    60 slow ones in its partition are taken, into the room kept for them, and the slow ones are left
    in Kafka (not held)."""
    monkeypatch.setattr(scheduler_module, "REFRESH_INTERVAL", 0.05)
    slow = [r for n in range(200) for r in records(f"slow{n}", 1, partition=n % 2, first_offset=n)]
    behind = [r for n in range(200, 260) for r in records(f"slow{n}", 1, partition=2, first_offset=n - 199)]
    feed = FakeFeed(records("fast", 1, partition=2) + slow + behind
                    + records("fast", 15, partition=2, first_offset=61), batch_size=10)
    redis = await redis_with({"fast": 100.0} | {f"slow{n}": 0.5 for n in range(260)})
    scheduler = make(feed, redis, never_ends, max_tasks=5, max_queued=200)
    runner = asyncio.create_task(scheduler.run())
    try:
        await until(lambda: not feed.records and len(feed.delivered) == 276)
        await asyncio.sleep(0.2)  # a look-up and a few rounds of the loop
        held = scheduler.held()
        assert not feed.paused
        # 180 slow ones held (the bound less the fast room; 4 of them running), a batch read past it
        # before it was seen, and the fast source's 15 (one running): at most the bound and a batch.
        assert 180 - 5 + 15 <= held <= 200 + 10, held
    finally:
        scheduler.stop()
        await runner


async def test_a_source_read_before_its_rate_waits_a_short_turn_not_a_paused_ones(monkeypatch) -> None:
    """Parked for PARK_DEFAULT_SECONDS, 7,000 URLs of a source read before its rate held its URLs
    parked later for 5 s behind them in their wait partition (bench.sources)."""
    monkeypatch.setattr(scheduler_module, "REFRESH_INTERVAL", 60)
    monkeypatch.setattr(scheduler_module, "NEW_SOURCE_REFRESH", 60)
    monkeypatch.setattr(sizing, "QUEUE_UNRATED", 10)
    feed = FakeFeed(records("new", 50), batch_size=50)
    producer = FakeProducer()
    scheduler = make(feed, await redis_with({}), never_ends, producer=producer, view=MonitorView({"paused": 0.0}))
    started = time.time()
    await run_until(scheduler, lambda: len(parked(producer)) >= 40)
    waits = [m["not_before"] - started for m in parked(producer)]
    assert all(PARK_UNJUDGED_SECONDS <= w < PARK_UNJUDGED_SECONDS + 2 for w in waits), (min(waits), max(waits))
    assert PARK_UNJUDGED_SECONDS < PARK_DEFAULT_SECONDS


async def fast_behind_slow_sources(answer_seconds: float) -> tuple[FakeFeed, Any, list[str], Handler]:
    """A worker's feed with 90 slow sources' URLs (their tasks take a minute: they hold the worker at
    its bound), ten of them ahead of a fast source's 150 in partition 2; the URLs crawled, in order."""
    slow = [r for n in range(80) for r in records(f"slow{n}", 1, partition=n % 2, first_offset=n)]
    ahead = [r for n in range(80, 90) for r in records(f"slow{n}", 1, partition=2, first_offset=n - 80)]
    feed = FakeFeed(slow + ahead + records("fast", 150, partition=2, first_offset=10), batch_size=20)
    redis = await redis_with({"fast": 5.0} | {f"slow{n}": 0.5 for n in range(90)})
    crawled: list[str] = []

    async def handle(request: CrawlRequest) -> float:
        if request.source != "fast":
            await asyncio.sleep(60)
        crawled.append(request.uuid)
        await asyncio.sleep(answer_seconds)
        return answer_seconds

    return feed, redis, crawled, handle


async def test_past_the_bound_a_fast_sources_excess_waits_in_kafka_and_is_read_again_as_it_runs_short(
        monkeypatch) -> None:
    """Past the bound a fast source whose queue is full has its next URLs left in Kafka, not parked,
    and its partition read again from what it left whenever its queue runs short: every one of its
    URLs is crawled once, none goes round a wait topic, while the slow sources' URLs wait in Kafka."""
    monkeypatch.setattr(scheduler_module, "REFRESH_INTERVAL", 0.05)
    monkeypatch.setattr(read_ahead_module, "REWIND_INTERVAL", 0.05)
    feed, redis, crawled, handle = await fast_behind_slow_sources(0.005)
    producer = FakeProducer()
    scheduler = make(feed, redis, handle, max_tasks=50, max_queued=50, producer=producer,
                     admission=held_slow_starts())
    await run_until(scheduler, lambda: len(crawled) == 150, timeout=10)
    assert sorted(crawled) == sorted(f"fast-{i}" for i in range(150))  # each once
    assert not [m for m in parked(producer) if m["source"] == "fast"]
    assert feed.seeks  # read again from what it left
    assert scheduler.held() <= 50 + 20  # the slow ones: the bound and a batch; the rest in Kafka


async def test_past_the_bound_a_fast_sources_urls_left_while_it_was_paused_are_read_again(monkeypatch) -> None:
    """Every REREAD_SECONDS past the bound every partition is read again from what it left: a fast
    source's URLs left while it was paused come in once the pause ends, though nothing marked them."""
    monkeypatch.setattr(scheduler_module, "REFRESH_INTERVAL", 0.05)
    monkeypatch.setattr(read_ahead_module, "REREAD_SECONDS", 0.3)
    slow = [r for n in range(80) for r in records(f"slow{n}", 1, partition=n % 2, first_offset=n)]
    feed = FakeFeed(records("fast", 1, partition=2) + slow, batch_size=20)
    redis = await redis_with({"fast": 100.0} | {f"slow{n}": 0.5 for n in range(80)})
    crawled: list[str] = []
    first_done = asyncio.Event()

    async def handle(request: CrawlRequest) -> float:
        if request.source != "fast":
            await asyncio.sleep(60)  # the slow sources hold the worker at its bound
        elif request.uuid == "fast-0":
            await first_done.wait()  # it works here, so its pause is read
        crawled.append(request.uuid)
        return 0.005

    view = MonitorView()
    scheduler = make(feed, redis, handle, max_tasks=50, max_queued=50, view=view, admission=held_slow_starts())
    runner = asyncio.create_task(scheduler.run())
    fast = lambda: [u for u in crawled if u.startswith("fast")]  # noqa: E731
    try:
        await until(lambda: view.rate("fast") == 100.0 and not feed.records)
        await redis.set(rate_limit_key("fast"), 0.0)  # paused: its next URLs are left, unmarked
        await until(lambda: view.rate("fast") == 0.0)
        feed.records.extend(records("fast", 20, partition=2, first_offset=1))
        await until(lambda: not feed.records)
        await asyncio.sleep(0.5)
        first_done.set()
        await until(lambda: fast() == ["fast-0"])
        await redis.set(rate_limit_key("fast"), 100.0)
        await until(lambda: len(fast()) == 21, timeout=5)
    finally:
        scheduler.stop()
        await runner
    assert sorted(fast()) == sorted(["fast-0"] + [f"fast-{i}" for i in range(20)])  # each once (two fast-0s)


async def test_past_the_bound_a_partition_that_left_many_records_is_not_paused_ahead_of_a_fast_sources_urls(
        monkeypatch) -> None:
    """A partition pauses past the bound once it has read READ_AHEAD_MAX records that no fast source
    needed; the fast source's own URLs left there (its queue full) do not count, and a reading again
    (every REREAD_SECONDS, or by need) resumes it: its URLs are all crawled, though the partition
    left far more than READ_AHEAD_MAX of them (it once stayed paused for minutes)."""
    monkeypatch.setattr(scheduler_module, "REFRESH_INTERVAL", 0.05)
    monkeypatch.setattr(read_ahead_module, "REWIND_INTERVAL", 0.05)
    monkeypatch.setattr(read_ahead_module, "REREAD_SECONDS", 0.3)
    monkeypatch.setattr(read_ahead_module, "READ_AHEAD_MAX", 20)
    feed, redis, crawled, handle = await fast_behind_slow_sources(0.02)
    scheduler = make(feed, redis, handle, max_tasks=50, max_queued=50, admission=held_slow_starts())
    await run_until(scheduler, lambda: len(crawled) == 150, timeout=10)
    assert sorted(crawled) == sorted(f"fast-{i}" for i in range(150))  # each once
