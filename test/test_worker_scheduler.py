"""The scheduler with a fake consumer: slots by need, parking, halts, commits, shutdown."""
from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import pytest

from common.contracts import (ADAPTIVE_CEILING_FIELD, ADAPTIVE_SLOW_START_FIELD, HALTED, HALTED_URLS_TOPIC,
                              INBOUND_SOURCES,
                              REJECTED_TOPIC, adaptive_key,
                              TEMP_HALTED, URLS_TOPIC, WAIT_TOPICS, CrawlRequest, finished_offsets_key,
                              rate_limit_key)
from test.worker_fakes import FakeFeed, FakeProducer, FakeRedis
from worker.scheduling import scheduler as scheduler_module
from worker.scheduling.slots import need, reserve
from worker.constants import (PARK_DEFAULT_SECONDS, PARK_RETURN_LEAD_SECONDS, PARK_TRUST_SECONDS, PARK_UNJUDGED_SECONDS,
                              QUEUE_MAX_PER_SOURCE, QUEUE_SECONDS, QUEUE_UNRATED, THROUGHPUT_SMOOTHING,
                              THROUGHPUT_WARMUP_SECONDS)
from worker.intake.feed import Batch, Record
from worker.intake.offsets import PartitionOffsets
from worker.monitor_view import MonitorView
from worker.parking.wait_topics import ahead_of_turn, next_turn
from worker.scheduling import sizing
from worker.scheduling.lanes import Job, Lane, Lanes, starters
from worker.scheduling.scheduler import Running, Scheduler
from worker.fetching.tokens import TokenBuckets
from worker.imaging import turns

pytestmark = pytest.mark.paced  # runs by itself, after the rest (pytest.ini)


URLS_0 = (URLS_TOPIC, 0)


def records(source: str, count: int, partition: int = 0, first_offset: int = 0) -> list[Record]:
    out = []
    for i in range(count):
        value = json.dumps({"url": f"http://{source}.example/{i}.jpg", "uuid": f"{source}-{i}",
                            "source": source}).encode()
        out.append(Record(URLS_TOPIC, partition, first_offset + i, value))
    return out


def interleaved(*sources: list[Record]) -> list[Record]:
    """The sources' records in one partition, in the order given, renumbered."""
    return [Record(URLS_TOPIC, 0, offset, r.value) for offset, r in enumerate(r for rs in sources for r in rs)]


async def redis_with(sources: dict[str, float], judged: bool = True) -> FakeRedis:
    """Sources granted their rates; ``judged``: with the monitor's adaptive state (past any slow start)."""
    redis = FakeRedis()
    await redis.sadd(INBOUND_SOURCES, *sources)
    for source, rate in sources.items():
        await redis.set(rate_limit_key(source), rate)
        if judged:
            redis.store[adaptive_key(source)] = {ADAPTIVE_CEILING_FIELD: str(rate), ADAPTIVE_SLOW_START_FIELD: "0"}
    return redis


def make(feed, redis, handle, max_tasks=50, producer=None, max_queued=10_000, view=None, admission=None) -> Scheduler:
    view = view or MonitorView()
    return Scheduler(feed, redis, handle, producer or FakeProducer(), TokenBuckets(redis, view), view,
                     max_tasks=max_tasks, shutdown_timeout=5.0, max_queued=max_queued, admission=admission)


async def take_token(tokens: TokenBuckets, source: str) -> None:
    """What the fetcher does around its host slot, without the slot."""
    async with tokens.turn(source):
        while True:
            await tokens.until_available(source)
            if await tokens.take(source):
                return


async def until(condition, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def run_until(scheduler: Scheduler, condition, timeout: float = 10.0) -> None:
    runner = asyncio.create_task(scheduler.run())
    try:
        await until(condition, timeout)
    finally:
        scheduler.stop()
        await runner


def peak_tracking(others: float, **seconds: float) -> tuple[Counter[str], Callable[[CrawlRequest], Awaitable[float]]]:
    """A crawl lasting ``seconds[source]`` (``others`` for the rest), and each source's most at once."""
    running: Counter[str] = Counter()
    peak: Counter[str] = Counter()

    async def handle(request: CrawlRequest) -> float:
        running[request.source] += 1
        peak[request.source] = max(peak[request.source], running[request.source])
        await asyncio.sleep(seconds.get(request.source, others))
        running[request.source] -= 1
        return 0.2
    return peak, handle


async def never_ends(request: CrawlRequest) -> float:
    """A crawl that outlasts the test: its source keeps what it has queued."""
    await asyncio.sleep(60)
    return 0.0


def parked(producer: FakeProducer) -> list[dict]:
    """The messages parked in the wait topics."""
    return [m for t in WAIT_TOPICS for m in producer.on(t)]


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
    # The same, told how many sources share the worker rather than handed those at their floor.
    assert reserve({"huge": 2000.0}, capacity=100, floor=1, sources=501) == crowded
    assert reserve({"fast": 20.0}, capacity=500, floor=1, sources=3001) == {"fast": 20}
    assert reserve({"a": 30.0, "b": 10.0}, capacity=22, floor=1, sources=2) == {"a": 15, "b": 5}


@pytest.mark.parametrize("pace, latency, held, slots", [
    (100.0, 0.2, 1000, 40.0),  # rate x latency x headroom (2)
    (0.5, 1.0, 10, 1.0),       # a slow site: its floor
    (32.0, 1.0, 1, 1.0),       # a site with one URL here: one slot, whatever its rate
    (32.0, 1.0, 0, 0.0),       # nothing here
    (32.0, 0.2, 5, 5.0),       # fewer URLs here than its rate could keep busy
    (32.0, 0.2, 500, 12.8),
])
def test_a_source_needs_its_rate_times_its_latency_but_no_more_slots_than_urls(
        pace: float, latency: float, held: int, slots: float) -> None:
    assert need(pace, latency, held, headroom=2.0) == pytest.approx(slots)


async def test_a_big_source_gets_slots_among_many_one_url_sources_of_the_same_pace() -> None:
    """Every site of a URL list may discover, so while they slow-start all are paced by the
    discovery ceiling: sized by their rate alone, 300 one-URL sites needed 64 slots apiece, the
    big source's reservation was scaled to 0 and it ran one task at a time."""
    ones = {f"one{i}": 32.0 for i in range(300)}
    feed = FakeFeed(records("big", 200) + [r for n, s in enumerate(ones) for r in records(s, 1, partition=1 + n)])
    peak, handle = peak_tracking(big=0.2, others=2.0)

    scheduler = make(feed, await redis_with({"big": 32.0, **ones}), handle, max_tasks=100)
    await run_until(scheduler, lambda: peak["big"] >= 10, timeout=5.0)
    assert max(peak[s] for s in ones) == 1


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
    assert feed.committed()[URLS_0] == 3
    blocked.set()
    scheduler.stop()
    await runner
    assert feed.committed()[URLS_0] == 10
    assert feed.subscriptions == [[URLS_TOPIC]]  # once, whatever the sources


async def test_fast_source_gets_slots_by_need_among_many_slow_ones() -> None:
    slow = {f"slow{i}": 0.5 for i in range(60)}
    feed = FakeFeed(records("fast", 400) + [r for n, s in enumerate(slow) for r in records(s, 3, partition=1 + n)])
    peak, handle = peak_tracking(fast=0.2, others=0.5)

    scheduler = make(feed, await redis_with({"fast": 100.0, **slow}), handle, max_tasks=50)
    loads = []  # what the worker's /metrics reads (worker.metrics), once every source has run

    def all_ran() -> bool:
        if peak["fast"] >= 25 and len(peak) == 61:
            loads.append(scheduler.load())
        return bool(loads)

    await run_until(scheduler, all_ran)
    # Equal shares would give the fast source 50 / 61 = 0 or 1 slot.
    assert max(peak[s] for s in slow) == 1
    load = loads[0]
    assert load.slots["reserved"] >= 20 and load.slots["reserved"] + load.slots["shared"] == 50
    assert 0 < load.in_flight["reserved"] <= load.slots["reserved"]  # the fast source's
    assert load.in_flight["shared"] <= load.slots["shared"] and sum(load.in_flight.values()) <= 50
    assert load.waiting > 0  # 400 fast URLs did not all fit


async def test_a_slow_source_ahead_in_the_partition_holds_back_no_other_source(monkeypatch) -> None:
    """Issue 26: 2,000 URLs of a 1 req/s source, then a fast source's, in one partition. The
    slow one queues QUEUE_SECONDS of its rate; the rest is parked in the wait topics, each
    URL at its turn 1/rate apart, and committed: the fast source's URLs behind it are read
    and crawled at once, and the partition is never paused."""
    monkeypatch.setattr(scheduler_module, "REFRESH_INTERVAL", 0.05)
    feed = FakeFeed(interleaved(records("slow", 2000), records("fast", 200)), batch_size=500)
    producer = FakeProducer()
    crawled = Counter()

    async def handle(request: CrawlRequest) -> float:
        await asyncio.sleep(1.0 if request.source == "slow" else 0.01)  # a token a second
        crawled[request.source] += 1
        return 0.01

    view = MonitorView({"slow": 1.0, "fast": 100.0}, judged={"slow", "fast"})  # as a refresh reads them
    scheduler = make(feed, await redis_with({"slow": 1.0, "fast": 100.0}), handle, producer=producer, view=view)
    started = time.time()
    holding: list[int] = []  # URLs queued or running here, when the slow source's are parked

    def parked_all() -> bool:
        if crawled["fast"] == 200 and len([m for topic in WAIT_TOPICS for m in producer.on(topic)]) >= 2000 - 10:
            load = scheduler.load()
            holding.append(load.waiting + sum(load.in_flight.values()))
        return bool(holding)

    await run_until(scheduler, parked_all)
    parked = [m for topic in WAIT_TOPICS for m in producer.on(topic)]
    assert {m["source"] for m in parked} == {"slow"} and crawled["slow"] <= 5
    waits = sorted(m["not_before"] for m in parked)
    gaps = [round(b - a, 3) for a, b in zip(waits, waits[1:], strict=False)]
    assert all(0.99 <= gap <= 1.01 for gap in gaps), sorted(gaps)[:5] + sorted(gaps)[-5:]  # one a second
    assert waits[0] - started < QUEUE_SECONDS + 5 and not feed.pauses
    assert holding[0] <= 10  # parked URLs are done here: only the slow queue holds the commit


async def test_what_a_worker_holds_is_bounded_whatever_the_number_of_sources() -> None:
    """MAX_QUEUED_URLS: past it the slow sources' URLs are read and left in Kafka, uncommitted, and
    read again once half has gone; each URL is crawled once."""
    urls = [r for n in range(300) for r in records(f"s{n}", 1, partition=n % 4, first_offset=n)]
    feed = FakeFeed(urls, batch_size=50)
    release = asyncio.Event()
    crawled: list[str] = []

    async def handle(request: CrawlRequest) -> float:
        crawled.append(request.uuid)
        await release.wait()
        return 0.01

    scheduler = make(feed, await redis_with({f"s{n}": 0.5 for n in range(300)}), handle, max_tasks=10,
                     max_queued=100)
    most = [0]

    def blocked() -> bool:  # every record read, the worker at its bound, nothing finished
        most[0] = max(most[0], scheduler.held() + sum(scheduler.load().in_flight.values()))
        return not feed.records and len(feed.delivered) == 300

    runner = asyncio.create_task(scheduler.run())
    try:
        await until(blocked)
        await asyncio.sleep(0.1)
        assert 100 <= most[0] <= 100 + 50 + 10  # the bound, a batch read past it, the running tasks
        left = {(u.partition, u.offset) for u in urls} - {
            (u.partition, u.offset) for u in urls if json.loads(u.value)["uuid"] in crawled}
        assert 300 - len(crawled) - scheduler.held() >= 300 - 100 - 50 - 10  # the rest in Kafka, not held
        for (_topic, partition), position in feed.committed().items():  # never past what is left
            assert position <= min(offset for p, offset in left if p == partition)
        release.set()
        await until(lambda: len(set(crawled)) == 300)
        await asyncio.sleep(0.2)
    finally:
        scheduler.stop()
        await runner
    assert feed.seeks  # read again from what was left
    assert len(crawled) == 300  # each once
    assert feed.committed() == {(URLS_TOPIC, p): 300 - 4 + p + 1 for p in range(4)}


async def test_halted_source_is_parked_until_resumed_and_holds_back_nothing(monkeypatch) -> None:
    monkeypatch.setattr(scheduler_module, "REFRESH_INTERVAL", 0.1)
    feed = FakeFeed(interleaved(records("bad", 5), records("good", 5)))
    redis = await redis_with({"good": 10.0, "bad": 10.0})
    await redis.sadd(HALTED, "bad")
    await redis.sadd(TEMP_HALTED, "other")
    producer = FakeProducer()
    crawled = []

    async def handle(request: CrawlRequest) -> float:
        crawled.append(request.source)
        return 0.01

    scheduler = make(feed, redis, handle, producer=producer)
    await run_until(scheduler, lambda: crawled.count("good") == 5 and feed.committed().get(URLS_0) == 10)
    assert "bad" not in crawled and not feed.pauses
    assert sorted(m["uuid"] for m in producer.on(HALTED_URLS_TOPIC)) == [f"bad-{i}" for i in range(5)]


async def test_invalid_message_goes_to_rejected_messages_and_is_committed() -> None:
    bad = Record(URLS_TOPIC, 0, 0, b"{not json")
    feed = FakeFeed([bad])
    producer = FakeProducer()
    scheduler = make(feed, await redis_with({"a": 1.0}), lambda r: asyncio.sleep(0, 0.0), producer=producer)
    await run_until(scheduler, lambda: producer.on(REJECTED_TOPIC))
    (rejected,) = producer.on(REJECTED_TOPIC)
    assert rejected["topic"] == URLS_TOPIC and rejected["raw"] == "{not json"
    assert feed.committed()[URLS_0] == 1


async def test_stop_finishes_requests_in_flight_and_parks_token_waiters(monkeypatch) -> None:
    """Left unfinished, the waiters held the partition's commit and the next owner read again all
    that finished above them: 1,296 requests for 592 URLs after two stops of every worker
    (test_all_workers_stopped_together_then_one_started). Parked, the commit passes them."""
    feed = FakeFeed(records("a", 4))
    redis = await redis_with({"a": 50.0})  # paced 20 ms apart: both go at once
    await redis.set("currtokens:a", 2)  # two can go; two wait for tokens that never come
    view = MonitorView()
    tokens = TokenBuckets(redis, view)
    finished = []

    async def handle(request: CrawlRequest) -> float:
        await take_token(tokens, request.source)
        await asyncio.sleep(0.3)
        finished.append(request.uuid)
        return 0.3

    producer = FakeProducer()
    scheduler = Scheduler(feed, redis, handle, producer, tokens, view, max_tasks=10, shutdown_timeout=5.0)
    runner = asyncio.create_task(scheduler.run())
    await asyncio.sleep(0.45)  # its rate is read 0.2 s after its first URL: two slots from then
    scheduler.stop()
    async with asyncio.timeout(5):
        await runner
    assert sorted(finished) == ["a-0", "a-1"]
    assert sorted(m["uuid"] for m in parked(producer)) == ["a-2", "a-3"]  # nothing was sent for them
    assert feed.committed()[URLS_0] == 4


async def test_stop_parks_the_queued_urls_and_commits_past_them() -> None:
    feed = FakeFeed(records("a", 30))
    producer = FakeProducer()
    crawled: list[str] = []

    async def handle(request: CrawlRequest) -> float:
        await asyncio.sleep(0.2)
        crawled.append(request.uuid)
        return 0.2

    scheduler = make(feed, await redis_with({"a": 5.0}), handle, max_tasks=2, producer=producer)
    at_stop: dict[str, int] = {}

    def crawling_with_most_queued() -> bool:
        running = scheduler.running().tasks
        if feed.records or len(crawled) < 2 or not running or scheduler.load().waiting <= 20:
            return False
        at_stop.update(crawled=len(crawled), running=running)
        return True
    await run_until(scheduler, crawling_with_most_queued)
    # Those running when it stopped finished (or, still waiting for their token, were parked); the
    # rest were parked; each URL once, and the commit passed them all.
    assert sorted(crawled + [m["uuid"] for m in parked(producer)]) == sorted(f"a-{i}" for i in range(30))
    assert at_stop["crawled"] <= len(crawled) <= at_stop["crawled"] + at_stop["running"]
    assert feed.committed()[URLS_0] == 30



async def test_shutdown_timeout_bounds_the_drain(monkeypatch) -> None:
    feed = FakeFeed(records("a", 1))
    scheduler = Scheduler(feed, await redis_with({"a": 1.0}), never_ends, FakeProducer(),
                          TokenBuckets(FakeRedis()), MonitorView(), max_tasks=10, shutdown_timeout=0.3)
    runner = asyncio.create_task(scheduler.run())
    await asyncio.sleep(0.2)
    scheduler.stop()
    async with asyncio.timeout(5):
        await runner
    assert URLS_0 not in feed.committed()


async def test_halting_a_source_frees_slots_of_its_token_waiters_and_parks_their_urls(monkeypatch) -> None:
    monkeypatch.setattr(scheduler_module, "REFRESH_INTERVAL", 0.05)
    feed = FakeFeed(records("a", 3))
    producer = FakeProducer()
    redis = await redis_with({"a": 1.0})
    await redis.set("currtokens:a", 0)
    view = MonitorView()
    tokens = TokenBuckets(redis, view)
    done = []

    async def handle(request: CrawlRequest) -> float:
        await take_token(tokens, request.source)
        done.append(request.uuid)
        return 0.01

    scheduler = Scheduler(feed, redis, handle, producer, tokens, view, max_tasks=10, shutdown_timeout=5.0)
    runner = asyncio.create_task(scheduler.run())

    def running() -> int:
        return sum(scheduler.load().in_flight.values())

    async with asyncio.timeout(10):
        while running() == 0:
            await asyncio.sleep(0.01)
        await redis.sadd(TEMP_HALTED, "a")
        while running() or feed.committed().get(URLS_0) != 3:  # slots given back, URLs parked
            await asyncio.sleep(0.01)
    scheduler.stop()
    await runner
    assert done == []
    parked = producer.on(WAIT_TOPICS[0])  # a temporary halt waits a turn, then is looked at again
    assert sorted(m["uuid"] for m in parked) == ["a-0", "a-1", "a-2"]
    assert all(abs(m["not_before"] - time.time() - PARK_DEFAULT_SECONDS) < 2 for m in parked)


async def test_a_paused_source_with_no_work_here_takes_all_its_urls_back_once_the_pause_ends(monkeypatch) -> None:
    """A Retry-After pause publishes rate 0 and the source's URLs are parked meanwhile, so it has
    no work here. Its rate, read only for sources with work here, stayed 0 after the pause: the
    URLs coming back were queued two at a time and the rest parked for PARK_DEFAULT_SECONDS
    again, two a turn (a 40 req/s source ended 10 URLs short of a 280 s crawl, test_e2e_crawl)."""
    monkeypatch.setattr(scheduler_module, "REFRESH_INTERVAL", 0.05)
    redis = await redis_with({"a": 0.0})
    feed, producer, done = FakeFeed(records("a", 1)), FakeProducer(), []

    async def handle(request: CrawlRequest) -> float:
        if not done:
            await asyncio.sleep(0.5)  # in flight as the pause is read
        done.append(request.uuid)
        return 0.01

    view = MonitorView()
    scheduler = make(feed, redis, handle, producer=producer, view=view)
    runner = asyncio.create_task(scheduler.run())
    try:
        await until(lambda: done and view.rate("a") == 0.0 and not sum(scheduler.load().in_flight.values()))
        await redis.set(rate_limit_key("a"), 40.0)  # the pause ends while its URLs wait elsewhere
        await asyncio.sleep(0.3)
        feed.records.extend(records("a", 20, first_offset=1))  # back from their wait, all at once
        await until(lambda: len(done) == 21)
    finally:
        scheduler.stop()
        await runner
    assert parked(producer) == []


async def test_unusable_rates_count_as_unknown() -> None:
    raws = ("2.5", "0", "-1", "nan", "inf", "fast", None)
    redis = FakeRedis()
    for n, raw in enumerate(raws):
        if raw is not None:
            await redis.set(rate_limit_key(f"s{n}"), raw)
    view = MonitorView()
    await view.refresh(redis, [f"s{n}" for n in range(len(raws))], [])
    assert [view.rate(f"s{n}") for n in range(len(raws))] == [2.5, 0.0, None, None, None, None, None]


async def test_parked_urls_are_spaced_by_the_limit_not_a_slow_start(monkeypatch) -> None:
    """A source in its slow start is granted a tenth of its limit: URLs parked 1/grant apart came
    back minutes after it had reached its limit (a 6 req/s source crawled at 1 req/s for two
    minutes). Its limit is read with its rate, and its parked URLs are spaced by it."""
    monkeypatch.setattr(scheduler_module, "REFRESH_INTERVAL", 0.05)
    feed = FakeFeed(records("a", 400), batch_size=100)
    redis = await redis_with({"a": 2.0})  # granted 2 req/s of its 20
    redis.store[adaptive_key("a")] = {ADAPTIVE_CEILING_FIELD: "20.0", ADAPTIVE_SLOW_START_FIELD: "1"}
    producer = FakeProducer()
    scheduler = make(feed, redis, never_ends, producer=producer)
    # 200-300 are parked, by when its rate is first read between the feed's batches of 100.
    # Slots by its limit too (the tokens keep the rate), from the next pass over the sources.
    await run_until(scheduler, lambda: (not feed.records and len(parked(producer)) >= 150
                                        and scheduler.load().slots["reserved"] >= 2))
    waits = sorted(m["not_before"] for m in parked(producer))
    gaps = [round(b - a, 3) for a, b in zip(waits, waits[1:], strict=False)]
    assert gaps.count(0.05) >= len(gaps) - 1, sorted(gaps)[-5:]  # 1/20 s apart, not 1/2


async def test_a_source_the_monitor_has_not_judged_yet_is_parked_for_a_turn_not_spaced(monkeypatch) -> None:
    """A new source is granted a tenth of its limit before its state is saved: spaced by that,
    8,000 URLs of a 100 req/s source were parked up to 15 minutes ahead and came back at
    10 req/s (bench.sources). Until its state is read it queues QUEUE_UNRATED URLs, and those
    beyond wait PARK_UNJUDGED_SECONDS, all together; once read, they are spaced by its pace."""
    monkeypatch.setattr(scheduler_module, "REFRESH_INTERVAL", 0.05)
    feed = FakeFeed(records("new", QUEUE_UNRATED + 300), batch_size=100)
    redis = await redis_with({"new": 10.0}, judged=False)  # its first grant; no adaptive:new yet
    producer = FakeProducer()
    view = MonitorView()
    scheduler = make(feed, redis, never_ends, producer=producer, view=view)
    started = time.time()
    runner = asyncio.create_task(scheduler.run())
    try:
        await until(lambda: not feed.records and len(parked(producer)) >= 250)  # some of the 300 run
        waits = [m["not_before"] - started for m in parked(producer)]
        first_parked = len(parked(producer))
        assert all(PARK_UNJUDGED_SECONDS <= w < PARK_UNJUDGED_SECONDS + 2 for w in waits), (min(waits), max(waits))
        redis.store[adaptive_key("new")] = {ADAPTIVE_CEILING_FIELD: "100.0", ADAPTIVE_SLOW_START_FIELD: "1"}
        await until(lambda: view.judged("new"))  # a refresh reads it: its queue waits to be trimmed
        feed.records.extend(records("new", 300, first_offset=QUEUE_UNRATED + 300))
        await until(lambda: len(parked(producer)) >= first_parked + 300)
    finally:
        scheduler.stop()
        await runner
    later = sorted(m["not_before"] for m in parked(producer)[-100:])
    gaps = [round(b - a, 3) for a, b in zip(later, later[1:], strict=False)]
    assert gaps.count(0.01) >= len(gaps) - 1, sorted(gaps)[-5:]  # 1/100 s apart: its limit's pace


async def test_an_unjudged_sources_urls_wait_in_its_queue_not_parked_for_a_turn(monkeypatch) -> None:
    """Parked before the monitor's first judgment, a 6 req/s source's last URLs came 5 s after the
    rest (72% of its limit, CI): a queue shorter than QUEUE_UNRATED waits for the judgment, and
    is trimmed by its pace once it is known."""
    monkeypatch.setattr(scheduler_module, "REFRESH_INTERVAL", 0.05)
    feed = FakeFeed(records("new", 300), batch_size=100)
    redis = await redis_with({"new": 6.0}, judged=False)
    producer = FakeProducer()
    view = MonitorView()
    scheduler = make(feed, redis, never_ends, producer=producer, view=view)
    runner = asyncio.create_task(scheduler.run())
    try:
        await until(lambda: not feed.records and view.rate("new") is not None)
        await asyncio.sleep(0.3)  # refreshes, still unjudged
        assert not parked(producer)
        redis.store[adaptive_key("new")] = {ADAPTIVE_CEILING_FIELD: "6.0", ADAPTIVE_SLOW_START_FIELD: "0"}
        await until(lambda: len(parked(producer)) > 0)
        await asyncio.sleep(0.3)
        load = scheduler.load()
        assert load.waiting <= sizing.queue_limit(True, 6.0, load.slots["reserved"]) < len(parked(producer))
    finally:
        scheduler.stop()
        await runner


@pytest.mark.parametrize("known, drain, reserved, limit", [
    (False, 1000.0, 0, QUEUE_UNRATED),             # its rate or the monitor's judgment not read yet
    (True, 1000.0, 0, int(1000 * QUEUE_SECONDS)),  # nothing measured: seconds of its pace
    (True, 140.0, 0, int(140 * QUEUE_SECONDS)),    # held to 70 req/s by its site: of twice that
    (True, 0.5, 3, 6),                             # twice its slots, if more
    (True, 0.1, 0, 2),                             # twice the floor at least
    (True, 100_000.0, 0, QUEUE_MAX_PER_SOURCE),    # an operator's override queues no more
])
def test_a_queue_holds_seconds_of_what_its_source_drains_at_here(known, drain, reserved, limit) -> None:
    """A queue holds its partition's commit at its oldest URL: seconds of what its source drains
    at here, not of its limit."""
    assert sizing.queue_limit(known, drain, reserved) == limit


@pytest.mark.parametrize("pace, achieved, running, latency, drain", [
    (1000.0, None, 0, 1.0, 1000.0),         # not measured here: its pace
    (1000.0, 70.0, 0, 1.0, 140.0),          # held below it (a site's connection cap): twice what it achieves
    (200.0, 3.0, 0, 1.0, 6.0),
    (200.0, 3.0, 45, 3.5, 2 * 45 / 3.5),    # but not below twice what its running tasks sustain
    (200.0, 3.0, 400, 3.5, 200.0),          # never above its pace
    (20.0, 0.1, 0, 1.0, 1.0),               # nor below 1 req/s
    (20.0, 19.0, 1, 1.0, 20.0),
])
def test_a_queue_drains_at_its_pace_or_twice_what_it_achieves_here(pace, achieved, running, latency, drain) -> None:
    assert sizing.drain_rate(pace, achieved, running, latency) == pytest.approx(drain)


@pytest.mark.parametrize("rate, limit, pace", [
    (2.0, 20.0, 20.0), (2.0, None, 2.0), (None, None, 0.0), (30.0, 20.0, 30.0)])
def test_a_source_is_paced_by_its_grant_or_its_limit_while_it_slow_starts(rate, limit, pace) -> None:
    assert sizing.pace(rate, limit) == pace


@pytest.mark.parametrize("queued, pace, seconds", [
    (130, 32.0, 130 / 32),  # a big site's queue: seconds of it at its pace
    (0, 32.0, 0.0),         # a one-URL site, its URL running: nothing behind it
    (1, 0.5, 2.0),          # a slow site's next URL
    (5000, 10.0, 10.0),     # at most HEAD_START_MAX_SECONDS
    (50, 0.0, 0.0),         # not rated yet
])
def test_a_sources_images_go_ahead_by_the_seconds_its_queue_needs(queued, pace, seconds) -> None:
    assert sizing.head_start(queued, pace) == pytest.approx(seconds)


async def test_a_task_sees_its_own_sources_head_start() -> None:
    """What the pool is told when a task's image is ready: its source's queue here at its pace."""
    seen: dict[str, list[float]] = {}

    async def handle(request: CrawlRequest) -> float:
        await asyncio.sleep(0.05)
        seen.setdefault(request.source, []).append(turns.head_start())
        return 0.05

    ones = {f"one{i}": 10.0 for i in range(20)}
    feed = FakeFeed(records("big", 100) + [r for n, s in enumerate(ones) for r in records(s, 1, partition=1 + n)])
    scheduler = make(feed, await redis_with({"big": 10.0, **ones}), handle)
    await run_until(scheduler, lambda: len(seen.get("big", [])) >= 5 and len(seen) > 10)
    assert max(seen["big"]) > 1.0  # tens of URLs queued behind, at 10 req/s
    assert all(v == [0.0] for s, v in seen.items() if s != "big")


@pytest.mark.parametrize("previous, ended, running, ran_dry, measured", [
    (None, 70, 10, False, 70.0),                                   # a first measure
    (19.0, 3, 10, False, 19.0 + THROUGHPUT_SMOOTHING * (3 - 19)),  # smoothed
    (70.0, 10, 10, True, None),   # its queue ran dry: what came, not what it can do
    (19.0, 0, 0, False, 19.0),    # none of its URLs ran: held by this worker's slots, not its site
    (19.0, 0, 1, False, 19.0 + THROUGHPUT_SMOOTHING * (0 - 19)),   # one ran, none ended: held by its site
])
def test_what_a_source_achieves_here(previous, ended, running, ran_dry, measured) -> None:
    assert sizing.throughput(previous, ended, 1.0, running, ran_dry) == measured


def test_a_sources_first_seconds_here_and_its_idle_time_do_not_size_its_queue() -> None:
    """Measured over its first 0.2 s (its robots.txt, its first tokens), a 20 req/s source would
    drain at 4; idle here, what it achieved is history."""
    lane = Lane("new")
    lane.queue.append(Job(URLS_0, 0, None))
    lane.measure(0.2, now=100.0, counted=True)  # it has work here from now on
    lane.ended = 1
    lane.measure(0.2, now=100.2, counted=True)
    assert lane.throughput is None  # its start is not what it can do
    lane.ended = 19
    lane.measure(1.0, now=100.0 + THROUGHPUT_WARMUP_SECONDS, counted=True)
    assert lane.throughput == 19.0
    lane.ran_dry = True
    lane.measure(1.0, now=101.0 + THROUGHPUT_WARMUP_SECONDS, counted=True)
    assert lane.throughput is None  # it ran out of URLs here
    lane.ended = 19
    lane.measure(1.0, now=102.0 + THROUGHPUT_WARMUP_SECONDS, counted=True)
    assert lane.throughput == 19.0
    lane.queue.clear()
    lane.measure(1.0, now=103.0 + THROUGHPUT_WARMUP_SECONDS, counted=True)
    assert lane.throughput is None and lane.working_since is None  # idle: history


NOW = 1_000_000.0


@pytest.mark.parametrize("rate, pace, queued, last_turn, known, judged, temp_halted, turn", [
    (140.0, 1000.0, 0, 0.0, True, True, False, (NOW + 1 / 140, True)),      # 1/rate apart, by what it drains at
    (140.0, 1000.0, 0, NOW + 1 / 140, True, True, False, (NOW + 2 / 140, True)),  # after its latest
    (100.0, 100.0, 500, 0.0, True, True, False, (NOW + 5.0 + 0.01, True)),  # after what it has queued
    (0.0, 0.0, 0, 0.0, True, True, False, (NOW + PARK_DEFAULT_SECONDS, False)),   # paused: rate 0
    (10.0, 10.0, 0, 0.0, True, True, True, (NOW + PARK_DEFAULT_SECONDS, False)),  # temporarily halted
    (10.0, 10.0, 0, 0.0, True, False, False, (NOW + PARK_UNJUDGED_SECONDS, False)),  # not judged yet
    (0.0, 0.0, 0, 0.0, False, False, False, (NOW + PARK_UNJUDGED_SECONDS, False)),   # rate not read yet
    (6.0, 100.0, 0, NOW + PARK_TRUST_SECONDS, True, True, False, (NOW + PARK_TRUST_SECONDS, False)),  # a turn ahead
    (100.0, 100.0, 0, NOW + PARK_TRUST_SECONDS, True, True, False, (NOW + PARK_TRUST_SECONDS + 0.01, True)),
])
def test_a_parked_url_comes_back_at_its_turn(rate, pace, queued, last_turn, known, judged, temp_halted, turn) -> None:
    not_before, latest = next_turn(NOW, rate, pace, queued, last_turn, rate_known=known, judged=judged,
                                   temp_halted=temp_halted)
    assert (not_before, latest) == (pytest.approx(turn[0]), turn[1])


def test_a_parked_url_is_written_to_come_back_ahead_of_its_turn() -> None:
    """Written with its turn itself, a parked URL reached its source's queue 0.05-0.85 s after the
    queue ran dry (the wait line's poll, the read of urls), and the source sent nothing meanwhile
    (test_e2e_halted: 0.46-0.73 s idle a source, docs/lab-notes/2026-11-28-share-below-grant.md)."""
    assert ahead_of_turn(NOW + 5.1, NOW) == pytest.approx(NOW + 5.1 - PARK_RETURN_LEAD_SECONDS)
    assert ahead_of_turn(NOW + 0.2, NOW) == NOW  # never in the past: a turn that close goes back at once
    turns = [next_turn(NOW, 10.0, 10.0, 50, NOW + k / 10.0, rate_known=True, judged=True, temp_halted=False)[0]
             for k in range(50, 60)]
    written = [ahead_of_turn(turn, NOW) for turn in turns]
    assert [round(b - a, 6) for a, b in zip(written, written[1:], strict=False)] == [0.1] * 9  # still 1/rate apart


def test_what_a_source_achieved_places_its_urls_one_turn_ahead_at_most() -> None:
    """A 100 req/s source that drains at 6 here: 1/6 s apart for one turn, the rest at its end, to
    be placed by what it achieves then."""
    last, waits = 0.0, []
    for _ in range(400):
        not_before, latest = next_turn(NOW, 6.0, 100.0, 0, last, rate_known=True, judged=True, temp_halted=False)
        last = not_before if latest else last
        waits.append(not_before)
    assert max(waits) <= NOW + PARK_TRUST_SECONDS
    assert len([w for w in waits if w < NOW + PARK_TRUST_SECONDS - 0.1]) == int(PARK_TRUST_SECONDS * 6) - 1


async def test_a_revoked_partitions_crawls_stop_and_the_others_go_on() -> None:
    """Left to finish, a revoked partition's crawls could not be committed and were crawled
    again by its next owner: 1,621 of 2,000 URLs twice after one SIGKILL's rebalance."""
    started: dict[str, asyncio.Event] = {}
    stopped: list[str] = []

    async def crawl(request: CrawlRequest) -> float:
        started.setdefault(request.uuid, asyncio.Event()).set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            stopped.append(request.uuid)
            raise
        return 0.0

    feed = FakeFeed(records("a", 3, partition=0) + records("b", 3, partition=1))
    scheduler = make(feed, await redis_with({"a": 100.0, "b": 100.0}), crawl)
    runner = asyncio.create_task(scheduler.run())
    try:
        await until(lambda: len(started) == 6)
        feed.revoke([URLS_0])
        await until(lambda: len(stopped) == 3)
        await asyncio.sleep(0.1)
        assert sorted(stopped) == ["a-0", "a-1", "a-2"]
        assert sum(scheduler.load().in_flight.values()) == 3  # b's
    finally:
        scheduler.stop()
        await runner
    assert URLS_0 not in feed.committed()  # nothing of the revoked partition committed after it


def lanes_of(waiting: str, reserved: str = "", fast: str = "") -> Lanes:
    """Lanes of one-letter sources: ``waiting`` have a URL queued, ``reserved`` a slot, ``fast`` are fast."""
    lanes = Lanes()
    for source in waiting:
        lane = lanes.lane(source)
        lane.queue.append(Job(URLS_0, 0, None))
        lanes.waiting[source] = lane
    lanes.reserved = {s: lanes.lane(s) for s in reserved}
    lanes.fast = {s: lanes.lane(s) for s in fast}
    return lanes


@pytest.mark.parametrize("waiting, reserved, fast, shared_free, slow_open, first_place, offered, next_place", [
    ("abc", "", "", 5, True, 0, "abc", 0),      # shared slots and the allowance: every queued lane, in rotation
    ("abc", "abc", "", -2, True, 0, "bca", 1),  # every slot taken: the reserved ones, the first place going round
    ("abc", "abc", "", -2, True, 1, "cab", 2),
    ("abc", "abc", "", -2, True, 2, "abc", 0),
    ("abc", "ab", "", 0, True, 0, "ba", 1),     # of them, those with URLs queued
    ("abc", "", "bc", 3, False, 0, "cb", 1),    # no allowance: the fast ones
    ("abc", "b", "bc", 0, False, 0, "b", 0),    # neither: the fast ones with a reservation
    ("ab", "c", "", 0, True, 4, "", 4),         # nothing can start
])
def test_a_freed_slot_goes_round_the_lanes_that_can_start(waiting, reserved, fast, shared_free, slow_open,
                                                         first_place, offered, next_place) -> None:
    """Offered in the same order each time, the first sources would take every slot that frees: a
    200 req/s source with 6 slots reserved had none running for 6 s while all 500 ran."""
    lanes, place = starters(lanes_of(waiting, reserved, fast), shared_free, slow_open, first_place)
    assert ("".join(lane.source for lane in lanes), place) == (offered, next_place)


async def test_a_crawl_revoked_before_its_first_step_gives_its_slot_back() -> None:
    """A task cancelled before it starts never enters its body: its slot comes back all the same."""
    entered: list[str] = []
    at_revocation: list[Running] = []

    async def crawl(request: CrawlRequest) -> float:
        entered.append(request.uuid)
        return await never_ends(request)

    class RevokingFeed(FakeFeed):
        """Its second poll answers at once with the partition revoked: the loop does not wait
        between the first batch's starts and the revocation, so no crawl has taken a step."""
        polls = 0

        async def poll(self, max_records: int, timeout: float) -> Batch:
            self.polls += 1
            if self.polls != 2:
                return await super().poll(max_records, timeout)
            at_revocation.append(scheduler.running())
            return Batch(revoked=[URLS_0])

    feed = RevokingFeed(records("a", 3))
    scheduler = make(feed, await redis_with({}), crawl, max_tasks=4, view=MonitorView(rates={"a": 100.0}))
    runner = asyncio.create_task(scheduler.run())
    try:
        await until(lambda: feed.polls >= 4)
        await asyncio.sleep(0.01)
        after = scheduler.running()
    finally:
        scheduler.stop()
        await runner
    assert at_revocation == [Running(tasks=3, on_slots=3, by_source={"a": 3}, by_partition={URLS_0: 3})]
    assert entered == []  # none had started
    assert after == Running(tasks=0, on_slots=0, by_source={}, by_partition={})


async def test_a_new_owner_skips_what_the_last_one_finished_above_its_commit() -> None:
    """Kafka's commit stops at a partition's lowest unfinished offset: after a crash, everything
    finished above it was read and requested again (17,692 of 20,000 URLs, test_e2e_halted).
    The finished offsets above the commit are recorded in Redis for the next owner."""
    redis = await redis_with({"a": 100.0})
    blocked = asyncio.Event()  # a-3: the request in flight when the first worker dies
    first: list[str] = []

    async def crashing(request: CrawlRequest) -> float:
        if request.uuid == "a-3":
            await blocked.wait()
        first.append(request.uuid)
        return 0.0

    feed = FakeFeed(records("a", 10))
    dying = make(feed, redis, crashing)
    runner = asyncio.create_task(dying.run())
    key = finished_offsets_key(*URLS_0)
    try:
        await until(lambda: feed.committed().get(URLS_0) == 3
                    and sorted(map(int, redis.store.get(key, {}))) == [4, 5, 6, 7, 8, 9])  # 0-2: trimmed
        # The next owner reads the partition from its commit, while the first has not let go.
        second: list[str] = []

        async def crawl(request: CrawlRequest) -> float:
            second.append(request.uuid)
            return 0.0

        next_feed = FakeFeed(records("a", 10)[3:])
        await run_until(make(next_feed, redis, crawl), lambda: next_feed.committed().get(URLS_0) == 10)
    finally:
        blocked.set()
        dying.stop()
        await runner
    assert second == ["a-3"]  # only what was in flight
    assert not redis.store.get(key)  # trimmed by the new owner's commit
