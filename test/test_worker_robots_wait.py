"""URLs whose robots.txt is unavailable wait in Kafka, not in a task (worker.parking.wait_topics*)."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

from common.contracts import CRAWL_ERRORS_TOPIC, URLS_TOPIC, WAIT_TOPICS, CrawlRequest, parse_crawl_request
from common.statuses import Status
from test.test_worker_task import SETTINGS, SOURCE, RefusingProducer, Run
from test.worker_fakes import FakeFeed, FakeProducer, FakeRedis
from worker.intake.feed import Record
from worker.fetching.fetch import FetchError
from worker.parking.wait_topics import decoded, hand_back, wait_message, wait_times
from worker.parking.hand_back_when_due import WaitLine


def unavailable(retry_in: float) -> FetchError:
    return FetchError(Status.ROBOTS_UNAVAILABLE, retry_at=time.time() + retry_in)


async def test_an_unavailable_robots_txt_sends_the_url_to_wait_not_to_an_end():
    run = await Run(unavailable(30))()
    assert not run.producer.on(CRAWL_ERRORS_TOPIC) and run.last_statuses() == []
    (waiting,) = run.producer.on(WAIT_TOPICS[0])
    assert abs(waiting["not_before"] - (time.time() + 30)) < 5 and waiting["due"] <= waiting["not_before"]
    assert abs(waiting["robots_wait_since"] - time.time()) < 5
    since = waiting["robots_wait_since"]
    assert parse_crawl_request(json.dumps(waiting)) == replace(run.request, robots_wait_since=since)


async def test_a_url_that_waited_past_the_give_up_ends_as_robots_unavailable():
    run = Run(unavailable(30))
    since = time.time() - SETTINGS.robots_unavailable_give_up - 1
    run.request = replace(run.request, robots_wait_since=since)
    await run()
    (error,) = run.producer.on(CRAWL_ERRORS_TOPIC)
    assert error["reason"] == "RobotsUnavailable"
    assert not any(run.producer.on(t) for t in WAIT_TOPICS)


async def test_a_wait_comes_back_at_the_give_up_time_if_that_is_sooner():
    run = Run(unavailable(3600))
    run.request = replace(run.request, robots_wait_since=time.time() - SETTINGS.robots_unavailable_give_up + 100)
    await run()
    (waiting,) = [m for t in WAIT_TOPICS for m in run.producer.on(t)]
    assert waiting["not_before"] - time.time() < 101


def test_waits_take_the_longest_turn_they_cover():
    request = CrawlRequest("http://h/x", "u", SOURCE, robots_wait_since=1000.0)
    now = 10_000.0
    for wait, topic, turn in [(5, 0, 5), (30, 0, 30), (45, 0, 45), (59.9, 0, 59.9), (60, 0, 30), (299, 0, 30),
                              (300, 1, 300), (3599, 1, 300),
                              (3600, 2, 3600), (86_400, 2, 3600)]:
        name, value = wait_message(request, now + wait, now)
        assert (name, wait_times(decoded(value))) == (WAIT_TOPICS[topic], (now + turn, now + wait)), wait


def record(topic: str, partition: int, offset: int, value: bytes) -> Record:
    return Record(topic, partition, offset, value)


async def test_the_line_hands_back_what_is_due_and_holds_the_rest_uncommitted():
    now = time.time()
    request = CrawlRequest("http://h/x", "due", SOURCE, robots_wait_since=now - 60)
    later = replace(request, uuid="later")
    again = replace(request, uuid="again")  # its turn is over, its wait is not: another turn
    first = WAIT_TOPICS[0]
    records = [record(first, 0, 0, request.to_json(not_before=now - 1, due=now - 1)),
               record(first, 0, 1, later.to_json(not_before=now + 0.6, due=now + 0.6)),
               record(first, 1, 5, again.to_json(not_before=now + 400, due=now - 1)),
               record(first, 1, 6, b"not json")]
    feed, producer = FakeFeed(records), FakeProducer()
    line = WaitLine(feed, producer, FakeRedis())
    running = asyncio.create_task(line.run())
    await asyncio.sleep(0.2)
    assert [m["uuid"] for m in producer.on(URLS_TOPIC)] == ["due"]
    assert feed.committed() == {(first, 0): 1, (first, 1): 7}
    assert (first, 0) not in feed.paused  # one held record is far from the partition's bound
    (turn,) = producer.on(WAIT_TOPICS[1])
    assert turn["uuid"] == "again" and turn["robots_wait_since"] == now - 60
    await asyncio.sleep(0.8)
    assert [m["uuid"] for m in producer.on(URLS_TOPIC)] == ["due", "later"]
    assert feed.committed()[(first, 0)] == 2
    line.stop()
    await asyncio.wait_for(running, 5)
    assert producer.on("rejected_messages")[0]["raw"] == "not json"


async def test_a_value_nested_past_the_parser_is_rejected_and_the_line_goes_on():
    now = time.time()
    request = CrawlRequest("http://h/x", "due", SOURCE, robots_wait_since=now - 60)
    first = WAIT_TOPICS[0]
    records = [record(first, 0, 0, b"[" * 100_000), record(first, 0, 1, request.to_json(not_before=now, due=now))]
    feed, producer = FakeFeed(records), FakeProducer()
    line = WaitLine(feed, producer, FakeRedis())
    running = asyncio.create_task(line.run())
    await asyncio.sleep(0.2)
    line.stop()
    await asyncio.wait_for(running, 5)
    assert [m["uuid"] for m in producer.on(URLS_TOPIC)] == ["due"]
    assert producer.on("rejected_messages")[0]["error"].startswith("not JSON: RecursionError")
    assert feed.committed() == {(first, 0): 2}


async def test_a_url_due_later_holds_back_no_url_due_sooner_behind_it(monkeypatch):
    """Issue 26: a 30 s turn ends early at its URL's time, so a partition mixes due times. Each
    is handed over when due; the commit stays below the first one still held; a partition
    holding its bound is paused until half of it has gone."""
    monkeypatch.setattr("worker.parking.hand_back_when_due.WAIT_HELD_PER_PARTITION", 4)
    now = time.time()
    first = WAIT_TOPICS[0]

    def waiting(uuid: str, offset: int, due: float) -> Record:
        request = CrawlRequest("http://h/x", uuid, SOURCE)
        return record(first, 0, offset, request.to_json(not_before=due, due=due))
    feed = FakeFeed([waiting("late", 0, now + 0.8), waiting("soon", 1, now - 1), waiting("a", 2, now + 60),
                     waiting("b", 3, now + 60), waiting("c", 4, now + 60), waiting("d", 5, now - 1)],
                    batch_size=1)
    producer = FakeProducer()
    line = WaitLine(feed, producer, FakeRedis())
    running = asyncio.create_task(line.run())
    await asyncio.sleep(0.3)
    assert [m["uuid"] for m in producer.on(URLS_TOPIC)] == ["soon"]  # not behind "late"
    assert feed.committed().get((first, 0), 0) == 0  # "late" is not handed over yet
    assert (first, 0) in feed.paused and len(feed.records) == 1  # late, a, b, c held: "d" waits unread
    await asyncio.sleep(0.9)
    assert [m["uuid"] for m in producer.on(URLS_TOPIC)] == ["soon", "late"]
    assert feed.committed()[(first, 0)] == 2  # "a" is the lowest still held
    assert (first, 0) in feed.paused  # three held: more than half the bound
    line.stop()
    await asyncio.wait_for(running, 5)


def test_a_parked_url_goes_back_to_the_partition_it_came_from() -> None:
    """So a fast source's parked URLs stay spread over its workers; a value out of range (a
    hostile or older message, or a topic that has fewer partitions) goes back by key."""
    request = CrawlRequest("http://h/x", "u", SOURCE)
    _, value = wait_message(request, 100.0, 10.0, partition=5)
    assert hand_back(decoded(value), 8) == {"partition": 5}
    assert hand_back(decoded(value), 4) == {}
    for hostile in (b'{"partition": -1}', b'{"partition": true}', b'{"partition": "3"}', b"[]", b"x", None):
        assert hand_back(decoded(hostile), 8) == {}
    assert parse_crawl_request(value) == request  # the extra key is no part of the request


async def test_a_hand_back_kafka_refuses_ends_the_url_in_crawl_errors_and_the_line_goes_on():
    """Issue 29: a message the broker refuses (too large, invalid) is not waited on."""
    now = time.time()
    first = WAIT_TOPICS[0]
    request = CrawlRequest("http://h/x", "refused", SOURCE, robots_wait_since=now - 60)
    feed = FakeFeed([record(first, 0, 0, request.to_json(not_before=now - 1, due=now - 1))])
    producer = RefusingProducer(URLS_TOPIC)
    line = WaitLine(feed, producer, FakeRedis())
    running = asyncio.create_task(line.run())
    await asyncio.sleep(0.2)
    line.stop()
    await asyncio.wait_for(running, 5)
    (error,) = producer.on(CRAWL_ERRORS_TOPIC)
    assert (error["identifier"], error["reason"]) == ("refused", "MessageRefused")
    assert feed.committed() == {(first, 0): 1}


async def run_wait_line(held: list[Record], redis: FakeRedis) -> tuple[FakeFeed, FakeProducer]:
    """A wait line over ``held`` for 0.3 s, then stopped: its feed and what it produced."""
    feed, producer = FakeFeed(held), FakeProducer()
    line = WaitLine(feed, producer, redis)
    running = asyncio.create_task(line.run())
    await asyncio.sleep(0.3)
    line.stop()
    await asyncio.wait_for(running, 5)
    return feed, producer


async def test_a_new_owner_of_a_wait_partition_hands_over_only_what_the_last_one_did_not():
    """A URL handed back above the wait partition's commit (one due later is held below it) is
    recorded for the next owner, which does not hand it back a second time after a crash."""
    now = time.time()
    first = WAIT_TOPICS[0]

    def waiting(uuid: str, offset: int, due: float) -> Record:
        return record(first, 0, offset, CrawlRequest("http://h/x", uuid, SOURCE).to_json(not_before=due, due=due))
    redis = FakeRedis()
    held = [waiting("later", 0, now + 600), waiting("a", 1, now - 1), waiting("b", 2, now - 1)]
    feed, producer = await run_wait_line(held, redis)
    assert [m["uuid"] for m in producer.on(URLS_TOPIC)] == ["a", "b"]
    assert feed.committed().get((first, 0), 0) == 0  # "later" holds the commit
    # The next owner reads it all again from the commit, and hands back only what is due and new.
    again = [waiting("later", 0, now - 1), waiting("a", 1, now - 1), waiting("b", 2, now - 1)]
    feed, producer = await run_wait_line(again, redis)
    assert [m["uuid"] for m in producer.on(URLS_TOPIC)] == ["later"]
    assert feed.committed()[(first, 0)] == 3
