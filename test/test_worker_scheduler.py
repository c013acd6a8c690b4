"""The scheduler with a fake consumer: slots by need, halts, commits, shutdown."""
from __future__ import annotations

import asyncio
import json
from collections import Counter

from common.contracts import (HALTED, INBOUND_SOURCES, REJECTED_TOPIC, TEMP_HALTED, CrawlRequest,
                              rate_limit_key, source_topic)
from test.worker_fakes import FakeFeed, FakeProducer, FakeRedis
from worker import scheduler as scheduler_module
from worker.allocation import reserve
from worker.constants import QUEUE_MAX_PER_SOURCE, QUEUE_SECONDS
from worker.feed import Record
from worker.offsets import PartitionOffsets
from worker.scheduler import Scheduler
from worker.tokens import TokenBuckets


def records(source: str, count: int, partitions: int = 1) -> list[Record]:
    out = []
    for i in range(count):
        value = json.dumps({"url": f"http://{source}.example/{i}.jpg", "uuid": f"{source}-{i}",
                            "source": source}).encode()
        out.append(Record(source_topic(source), i % partitions, i // partitions, value))
    return out


async def redis_with(sources: dict[str, float]) -> FakeRedis:
    redis = FakeRedis()
    await redis.sadd(INBOUND_SOURCES, *sources)
    for source, rate in sources.items():
        await redis.set(rate_limit_key(source), rate)
    return redis


def make(feed, redis, handle, max_tasks=50, producer=None) -> Scheduler:
    return Scheduler(feed, redis, handle, producer or FakeProducer(), TokenBuckets(redis), {},
                     max_tasks=max_tasks, shutdown_timeout=5.0)


async def take_token(tokens: TokenBuckets, source: str) -> None:
    """What the fetcher does around its host slot, without the slot."""
    async with tokens.one_at_a_time(source):
        while True:
            await tokens.until_available(source)
            if await tokens.take(source):
                return


async def run_until(scheduler: Scheduler, condition, timeout: float = 10.0) -> None:
    runner = asyncio.create_task(scheduler.run())
    try:
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0.01)
    finally:
        scheduler.stop()
        await runner


def test_reservations_follow_need_and_leave_room_for_floors() -> None:
    assert reserve({"fast": 40.0, "slow": 0.2}, capacity=500, floor=1) == {"fast": 40}
    # A source whose need exceeds the worker keeps half of it for everyone else.
    assert reserve({"huge": 2000.0, "a": 0.1, "b": 0.1}, capacity=100, floor=1) == {"huge": 97}
    crowded = reserve({"huge": 2000.0, **{f"s{i}": 0.1 for i in range(500)}}, capacity=100, floor=1)
    assert crowded == {"huge": 50}
    assert reserve({"a": 30.0, "b": 10.0}, capacity=22, floor=1) == {"a": 15, "b": 5}
    # A source that needs no more than its floor runs on it: 3,000 sources at 0.5 req/s x 1 s
    # x 2 once reserved a slot each and left the fast source one slot of its 20 (issue 20).
    assert reserve({"fast": 20.0, **{f"s{i}": 1.0 for i in range(3000)}}, capacity=500, floor=1) == {"fast": 20}


def test_commit_position_is_the_lowest_unfinished_offset() -> None:
    offsets = PartitionOffsets()
    for offset in (5, 6, 7, 8):
        offsets.add(offset)
    offsets.finish(7)
    assert offsets.committable() is None  # 5 is where the group already stands
    offsets.finish(5)
    assert offsets.committable() == 6
    offsets.committed = 6
    assert offsets.committable() is None
    offsets.finish(6)
    offsets.finish(8)
    assert offsets.committable() == 9


async def test_offsets_are_committed_only_below_unfinished_tasks() -> None:
    feed = FakeFeed(records("a", 10))
    blocked = asyncio.Event()
    done = []

    async def handle(request: CrawlRequest) -> float:
        if request.uuid == "a-3":
            await blocked.wait()
        done.append(request.uuid)
        return 0.01

    scheduler = make(feed, await redis_with({"a": 100.0}), handle)
    runner = asyncio.create_task(scheduler.run())
    async with asyncio.timeout(10):
        while len(done) < 9 or not feed.commits:
            await asyncio.sleep(0.02)
        await asyncio.sleep(1.2)  # one more commit interval
    assert feed.committed()[(source_topic("a"), 0)] == 3
    blocked.set()
    scheduler.stop()
    await runner
    assert feed.committed()[(source_topic("a"), 0)] == 10


async def test_fast_source_gets_slots_by_need_among_many_slow_ones() -> None:
    slow = {f"slow{i}": 0.5 for i in range(60)}
    feed = FakeFeed(records("fast", 400) + [r for s in slow for r in records(s, 3)])
    running, peak = Counter(), Counter()

    async def handle(request: CrawlRequest) -> float:
        running[request.source] += 1
        peak[request.source] = max(peak[request.source], running[request.source])
        await asyncio.sleep(0.2 if request.source == "fast" else 0.5)
        running[request.source] -= 1
        return 0.2

    scheduler = make(feed, await redis_with({"fast": 100.0, **slow}), handle, max_tasks=50)
    await run_until(scheduler, lambda: peak["fast"] >= 25 and len(peak) == 61)
    # Equal shares would give the fast source 50 / 61 = 0 or 1 slot.
    assert max(peak[s] for s in slow) == 1


async def test_a_fast_source_queues_seconds_of_its_rate_before_its_partitions_pause() -> None:
    # Pausing drops what the consumer prefetched, and a resumed partition waits for the next
    # fetch: a queue of only twice its slots (98 here) ran dry between fetches (issue 20).
    feed = FakeFeed(records("fast", 1000), batch_size=50)
    release = asyncio.Event()

    async def handle(request: CrawlRequest) -> float:
        await release.wait()
        return 0.2

    scheduler = make(feed, await redis_with({"fast": 100.0}), handle, max_tasks=50)
    # Released before the stop, or the stop would wait out its shutdown timeout for the tasks.
    await run_until(scheduler, lambda: (source_topic("fast"), 0) in feed.paused and not release.set())
    taken = 1000 - len(feed.records)
    assert taken >= 49 + int(100.0 * QUEUE_SECONDS)  # the running tasks and 5 s of URLs
    assert taken <= 49 + QUEUE_MAX_PER_SOURCE


async def test_halted_source_is_paused_and_not_crawled_until_resumed(monkeypatch) -> None:
    monkeypatch.setattr(scheduler_module, "REFRESH_INTERVAL", 0.1)
    feed = FakeFeed(records("good", 5) + records("bad", 5))
    redis = await redis_with({"good": 10.0, "bad": 10.0})
    await redis.sadd(HALTED, "bad")
    await redis.sadd(TEMP_HALTED, "other")
    crawled = []

    async def handle(request: CrawlRequest) -> float:
        crawled.append(request.source)
        return 0.01

    scheduler = make(feed, redis, handle)
    runner = asyncio.create_task(scheduler.run())
    async with asyncio.timeout(10):
        while crawled.count("good") < 5 or (source_topic("bad"), 0) not in feed.paused:
            await asyncio.sleep(0.02)
    assert "bad" not in crawled
    await redis.srem(HALTED, "bad")
    async with asyncio.timeout(10):
        while crawled.count("bad") < 5:
            await asyncio.sleep(0.02)
    assert (source_topic("bad"), 0) not in feed.paused
    scheduler.stop()
    await runner


async def test_invalid_message_goes_to_rejected_messages_and_is_committed() -> None:
    bad = Record(source_topic("a"), 0, 0, b"{not json")
    feed = FakeFeed([bad])
    producer = FakeProducer()
    scheduler = make(feed, await redis_with({"a": 1.0}), lambda r: asyncio.sleep(0, 0.0), producer=producer)
    await run_until(scheduler, lambda: producer.on(REJECTED_TOPIC))
    (rejected,) = producer.on(REJECTED_TOPIC)
    assert rejected["topic"] == source_topic("a") and rejected["raw"] == "{not json"
    assert feed.committed()[(source_topic("a"), 0)] == 1


async def test_stop_finishes_requests_in_flight_and_abandons_token_waiters(monkeypatch) -> None:
    feed = FakeFeed(records("a", 4))
    redis = await redis_with({"a": 50.0})  # paced 20 ms apart: both go at once
    await redis.set("currtokens:a", 2)  # two can go; two wait for tokens that never come
    tokens = TokenBuckets(redis)
    finished = []

    async def handle(request: CrawlRequest) -> float:
        await take_token(tokens, request.source)
        await asyncio.sleep(0.3)
        finished.append(request.uuid)
        return 0.3

    scheduler = Scheduler(feed, redis, handle, FakeProducer(), tokens, {}, max_tasks=10, shutdown_timeout=5.0)
    runner = asyncio.create_task(scheduler.run())
    await asyncio.sleep(0.15)
    scheduler.stop()
    async with asyncio.timeout(5):
        await runner
    assert sorted(finished) == ["a-0", "a-1"]
    assert feed.committed()[(source_topic("a"), 0)] == 2  # a-2 and a-3 stay for the next worker


async def test_shutdown_timeout_bounds_the_drain(monkeypatch) -> None:
    feed = FakeFeed(records("a", 1))

    async def handle(request: CrawlRequest) -> float:
        await asyncio.sleep(60)
        return 0.0

    scheduler = Scheduler(feed, await redis_with({"a": 1.0}), handle, FakeProducer(),
                          TokenBuckets(FakeRedis()), {}, max_tasks=10, shutdown_timeout=0.3)
    runner = asyncio.create_task(scheduler.run())
    await asyncio.sleep(0.2)
    scheduler.stop()
    async with asyncio.timeout(5):
        await runner
    assert (source_topic("a"), 0) not in feed.committed()


async def subscribed(monkeypatch, source: str, refresh: float, subscribe_interval: float, settle: float = 0.0):
    """A scheduler over no messages, running until it has subscribed to ``source``, its only one."""
    monkeypatch.setattr(scheduler_module, "REFRESH_INTERVAL", refresh)
    monkeypatch.setattr(scheduler_module, "SUBSCRIBE_INTERVAL", subscribe_interval)
    monkeypatch.setattr(scheduler_module, "SUBSCRIBE_SETTLE", settle)
    feed = FakeFeed([])
    redis = await redis_with({source: 1.0})
    scheduler = make(feed, redis, lambda r: asyncio.sleep(0, 0.0))
    runner = asyncio.create_task(scheduler.run())
    async with asyncio.timeout(5):
        while not feed.subscriptions:
            await asyncio.sleep(0.01)
    return feed, redis, scheduler, runner


async def announce_s01_to_s19(redis: FakeRedis, feed: FakeFeed, every: float) -> None:
    """Sources s01..s19 join inbound_sources one by one, ``every`` s apart; returns once the
    subscription holds all of them (and s00)."""
    async with asyncio.timeout(5):
        for n in range(1, 20):
            await redis.sadd(INBOUND_SOURCES, f"s{n:02d}")
            await asyncio.sleep(every)
        while len(feed.subscriptions[-1]) < 20:
            await asyncio.sleep(0.01)


async def test_new_sources_are_subscribed_when_they_appear(monkeypatch) -> None:
    feed, redis, scheduler, runner = await subscribed(monkeypatch, "a", refresh=0.05, subscribe_interval=0.0)
    async with asyncio.timeout(5):
        await redis.sadd(INBOUND_SOURCES, "b")
        while len(feed.subscriptions) < 2:
            await asyncio.sleep(0.01)
        await redis.srem(INBOUND_SOURCES, "a", "b")  # Redis restarted empty
        redis.store.pop(rate_limit_key("a"))
        await redis.sadd(INBOUND_SOURCES, "c")
        while len(feed.subscriptions) < 3:
            await asyncio.sleep(0.01)
    scheduler.stop()
    await runner
    assert feed.subscriptions == [[source_topic("a")], [source_topic("a"), source_topic("b")],
                                  [source_topic("a"), source_topic("b"), source_topic("c")]]
    assert scheduler.rates == {"a": 1.0}  # kept, though its key is gone


async def test_sources_that_trickle_in_join_the_subscription_together(monkeypatch) -> None:
    """Issue 20: a subscription change per new source is a group rebalance per new source."""
    feed, redis, scheduler, runner = await subscribed(monkeypatch, "s00", refresh=0.02, subscribe_interval=0.5)
    await announce_s01_to_s19(redis, feed, every=0.04)  # a new source every refresh or so, for ~0.8 s
    scheduler.stop()
    await runner
    assert feed.subscriptions[0] == [source_topic("s00")]  # the first at once
    assert len(feed.subscriptions) <= 4  # then at most one change per 0.5 s, not 19


async def test_sources_announced_in_a_burst_join_once_it_has_settled(monkeypatch) -> None:
    """The splitter announces thousands of new topics 500 at a time: one change, not one per chunk."""
    feed, redis, scheduler, runner = await subscribed(monkeypatch, "s00", refresh=0.02, subscribe_interval=0.0,
                                                      settle=0.3)
    await announce_s01_to_s19(redis, feed, every=0.05)  # a chunk of new sources every 0.05 s, for ~1 s
    scheduler.stop()
    await runner
    assert feed.subscriptions == [[source_topic("s00")], [source_topic(f"s{n:02d}") for n in range(20)]]


async def test_halting_a_source_frees_slots_of_its_token_waiters_and_keeps_their_urls(monkeypatch) -> None:
    monkeypatch.setattr(scheduler_module, "REFRESH_INTERVAL", 0.05)
    feed = FakeFeed(records("a", 3))
    redis = await redis_with({"a": 1.0})
    await redis.set("currtokens:a", 0)
    tokens = TokenBuckets(redis)
    done = []

    async def handle(request: CrawlRequest) -> float:
        await take_token(tokens, request.source)
        done.append(request.uuid)
        return 0.01

    scheduler = Scheduler(feed, redis, handle, FakeProducer(), tokens, {}, max_tasks=10, shutdown_timeout=5.0)
    runner = asyncio.create_task(scheduler.run())
    async with asyncio.timeout(10):
        while scheduler._total == 0:
            await asyncio.sleep(0.01)
        await redis.sadd(TEMP_HALTED, "a")
        while scheduler._total:  # the waiters gave their slots back
            await asyncio.sleep(0.01)
        await redis.srem(TEMP_HALTED, "a")
        await redis.set("currtokens:a", 3)
        while len(done) < 3:
            await asyncio.sleep(0.01)
    scheduler.stop()
    await runner
    assert sorted(done) == ["a-0", "a-1", "a-2"]
    assert feed.committed()[(source_topic("a"), 0)] == 3


def test_unusable_rates_count_as_unknown() -> None:
    assert [scheduler_module._as_rate(raw) for raw in ("2.5", "0", "-1", "nan", "inf", "fast", None)] == [
        2.5, 0.0, None, None, None, None, None]


async def test_a_worker_without_sources_looks_for_them_often(monkeypatch) -> None:
    monkeypatch.setattr(scheduler_module, "REFRESH_INTERVAL", 30.0)
    monkeypatch.setattr(scheduler_module, "IDLE_REFRESH_INTERVAL", 0.05)
    feed = FakeFeed([])
    redis = FakeRedis()
    scheduler = make(feed, redis, lambda r: asyncio.sleep(0, 0.0))
    runner = asyncio.create_task(scheduler.run())
    try:
        await asyncio.sleep(0.2)  # a few idle reads, none found
        await redis.sadd(INBOUND_SOURCES, "a")
        async with asyncio.timeout(2):  # not the 30 s of a worker that has sources
            while not feed.subscriptions:
                await asyncio.sleep(0.01)
    finally:
        scheduler.stop()
        await runner
    assert feed.subscriptions == [[source_topic("a")]]
