"""The splitter's batch step on fakes: routing, and commit only after every delivery."""
from __future__ import annotations

import json
import threading
import zlib

import pytest
from confluent_kafka import KafkaError

from common import contracts
from crawl_monitor.splitter import Splitter, Stopping, plan_batch
from test.test_monitor_fakes import FakeConsumer, FakeMessage, FakeProducer, FakeRedis


PARTITIONS = 64


def good(n: int, source: str = "Example", **extra) -> bytes:
    return json.dumps({"url": f"https://example.org/{n}.jpg", "uuid": f"u-{n}", "source": source,
                       **extra}).encode()


def make(batches, producer=None, redis=None, limits=None):
    consumer = FakeConsumer(batches)
    producer = producer or FakeProducer()
    redis = redis or FakeRedis()
    splitter = Splitter(consumer, producer, redis, limit_of=(limits or {}).get, inbound_topic="inbound",
                        url_partitions=PARTITIONS)
    return splitter, consumer, producer, redis, None


def test_plan_routes_each_message_and_commits_past_the_last_offset_per_partition() -> None:
    messages = [FakeMessage(good(1, "Flickr"), 10), FakeMessage(b"{not json", 11),
                FakeMessage(good(2, "met"), 5, partition=1), FakeMessage(None, 12),
                FakeMessage(None, -1, error="broker hiccup"), FakeMessage(b"[" * 100_000, 13)]
    plan = plan_batch(messages, "inbound", PARTITIONS)
    topics = [record[0] for record in plan.records]
    assert topics == ["urls", contracts.REJECTED_TOPIC, "urls"] + [contracts.REJECTED_TOPIC] * 2
    assert json.loads(plan.records[0][2])["source"] == "flickr" and plan.records[0][1] == b"flickr"
    rejected = json.loads(plan.records[1][2])
    assert rejected["topic"] == "inbound" and rejected["raw"] == "{not json"
    assert rejected["error"].startswith("not JSON")
    assert json.loads(plan.records[4][2])["error"].startswith("not JSON: RecursionError")  # deep nesting
    assert (plan.split, plan.rejected, dict(plan.new_urls)) == (2, 3, {"flickr": 1, "met": 1})
    assert sorted((tp.topic, tp.partition, tp.offset) for tp in plan.offsets) == [("inbound", 0, 14), ("inbound", 1, 6)]


def test_a_batch_is_produced_recorded_then_committed() -> None:
    splitter, consumer, producer, redis, created = make([[FakeMessage(good(n), n) for n in range(3)]])
    assert splitter.split_once(threading.Event()) == 3
    assert [topic for topic, _, _ in producer.delivered] == ["urls"] * 3
    assert consumer.commits == [[("inbound", 0, 3)]]
    assert redis.smembers(contracts.INBOUND_SOURCES) == {"example"} and redis.get(contracts.NUM_SPLIT) == "3"
    assert redis.get(contracts.urls_split_key("example")) == "3"
    assert "example" in redis.zrangebyscore(contracts.WAITING_SOURCES, "-inf", "+inf")


def test_a_slow_source_keeps_to_one_partition_and_a_fast_one_spreads_over_its_shards() -> None:
    """One partition per URL_RATE_PER_PARTITION req/s of the source's limit (SPEC.md §1), on
    consecutive partitions from the source's home, so its shards never share one."""
    batch = [FakeMessage(good(n, "slow"), n) for n in range(200)] + [
        FakeMessage(good(n, "fast"), 200 + n) for n in range(200)]
    splitter, _, producer, _, _ = make([batch], limits={"slow": 0.5, "fast": 100.0})
    splitter.split_once(threading.Event())
    by_source: dict[str, set[int | None]] = {}
    for (_, key, _), partition in zip(producer.delivered, producer.placed, strict=True):
        by_source.setdefault(key.decode(), set()).add(partition)
    assert len(by_source["slow"]) == 1
    home = zlib.crc32(b"fast") % PARTITIONS
    assert by_source["fast"] == {(home + i) % PARTITIONS for i in range(contracts.url_shards(100.0))} and (
        contracts.url_shards(100.0) == 4)


def test_a_retry_keeps_its_partition_and_is_not_a_new_url_of_the_backlog() -> None:
    first, retry = good(7, "fast"), good(7, "fast", attempts=1)
    splitter, _, producer, redis, _ = make([[FakeMessage(first, 1), FakeMessage(retry, 2)]], limits={"fast": 200.0})
    splitter.split_once(threading.Event())
    assert producer.placed[0] == producer.placed[1]
    assert redis.get(contracts.urls_split_key("fast")) == "1" and redis.get(contracts.NUM_SPLIT) == "2"


def test_url_partition_is_stable_and_in_range_for_any_identifier() -> None:
    for n, identifier in enumerate(["u", "\ud800", "../x", "é" * 200, ""]):
        for partitions in (1, 3, 256):
            place = contracts.url_partition(f"s{n}", identifier, 8, partitions)
            assert 0 <= place < partitions
            assert place == contracts.url_partition(f"s{n}", identifier, 8, partitions)
    limits = (None, 0.0, -1, float("nan"), float("inf"), 0.2, 25.0, 25.1, 200.0)
    assert [contracts.url_shards(limit) for limit in limits] == [1, 1, 1, 1, 1, 1, 1, 2, 8]


def test_failed_deliveries_are_resent_before_the_commit() -> None:
    producer = FakeProducer(fail_first=2, buffer_errors=3)
    splitter, consumer, _, _, _ = make([[FakeMessage(good(n), n) for n in range(5)]], producer=producer)
    splitter.split_once(threading.Event())
    assert sorted(json.loads(value)["uuid"] for _, _, value in producer.delivered) == [f"u-{n}" for n in range(5)]
    assert consumer.commits == [[("inbound", 0, 5)]]


def test_messages_that_timed_out_in_the_queue_are_resent(capsys) -> None:
    """librdkafka reports a message that never reached the broker with no partition or offset;
    reading its coordinates raised, and the whole batch was produced again (seen at 5,000 sources)."""
    producer = FakeProducer(fail_first=2, failed_offset=None)
    splitter, consumer, _, _, _ = make([[FakeMessage(good(n), n) for n in range(5)]], producer=producer)
    splitter.split_once(threading.Event())
    assert sorted(json.loads(value)["uuid"] for _, _, value in producer.delivered) == [
        f"u-{n}" for n in range(5)]  # once each
    assert consumer.commits == [[("inbound", 0, 5)]]
    assert "ValueError" not in capsys.readouterr().out  # resent as failures, not the batch retried


def test_redis_down_is_waited_out_without_resending_or_skipping(monkeypatch) -> None:
    redis = FakeRedis()
    redis.fail_next = 2
    splitter, consumer, producer, _, _ = make([[FakeMessage(good(1), 1)]], redis=redis)
    monkeypatch.setattr(threading.Event, "wait", lambda self, timeout=None: self.is_set())
    splitter.split_once(threading.Event())
    assert len(producer.delivered) == 1 and redis.get(contracts.NUM_SPLIT) == "1"
    assert consumer.commits == [[("inbound", 0, 2)]]


def test_stopping_during_a_failure_leaves_the_batch_uncommitted() -> None:
    producer = FakeProducer(fail_first=1)
    splitter, consumer, _, _, _ = make([[FakeMessage(good(1), 1)]], producer=producer)
    stop = threading.Event()
    stop.set()
    with pytest.raises(Stopping):
        splitter.split_once(stop)
    assert consumer.commits == []


def test_an_empty_poll_commits_nothing() -> None:
    splitter, consumer, producer, _, _ = make([])
    assert splitter.split_once(threading.Event()) == 0
    assert consumer.commits == [] and producer.delivered == []


def test_a_batch_of_only_rejects_still_commits(capsys) -> None:
    splitter, consumer, producer, redis, _ = make([[FakeMessage(b"[]", 7)]])
    splitter.split_once(threading.Event())
    assert [topic for topic, _, _ in producer.delivered] == [contracts.REJECTED_TOPIC]
    assert consumer.commits == [[("inbound", 0, 8)]] and redis.get(contracts.NUM_SPLIT) is None
    assert json.loads(capsys.readouterr().out)["count"] == 1


class RefusingProducer(FakeProducer):
    """The broker refuses every message whose value holds ``marker`` (as too large), every time."""

    def __init__(self, marker: bytes, refuse_rejections: bool = False):
        super().__init__()
        self.marker, self.refuse_rejections = marker, refuse_rejections

    def flush(self, timeout: float = 0) -> int:
        queued, self.queued = self.queued, []
        for topic, key, value, on_delivery, partition in queued:
            if self.marker in value and (topic != contracts.REJECTED_TOPIC or self.refuse_rejections):
                on_delivery(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE),
                            FakeMessage(value, -1, topic, key=key, partition=partition or 0))
            else:
                self.delivered.append((topic, key, value))
                self.placed.append(partition)
        return 0


@pytest.mark.parametrize("refuse_rejections", [False, True])
def test_a_message_the_broker_refuses_is_rejected_not_resent_forever(capsys, refuse_rejections: bool) -> None:
    """Resending it would get the same answer and hold the batch (and every source) forever."""
    producer = RefusingProducer(b"u-2", refuse_rejections)
    splitter, consumer, _, redis, _ = make([[FakeMessage(good(n), n) for n in range(4)]], producer=producer)
    assert splitter.split_once(threading.Event()) == 3
    assert sorted(json.loads(value)["uuid"] for topic, _, value in producer.delivered if topic == "urls") == [
        "u-0", "u-1", "u-3"]
    rejected = [json.loads(value) for topic, _, value in producer.delivered if topic == contracts.REJECTED_TOPIC]
    if refuse_rejections:
        assert rejected == [] and "the rejection is lost" in capsys.readouterr().out
    else:
        (record,) = rejected
        assert json.loads(record["raw"])["uuid"] == "u-2" and "MSG_SIZE_TOO_LARGE" in record["error"]
    assert consumer.commits == [[("inbound", 0, 4)]] and redis.get(contracts.NUM_SPLIT) == "3"
    assert redis.get(contracts.urls_split_key("example")) == "3"  # the refused one is no URL of the backlog


async def test_a_batch_of_many_sources_is_counted_by_one_script_on_the_real_redis(redis_url: str) -> None:
    """RECORD_SPLIT on Redis itself: every source in inbound_sources and waiting_sources (its SADD
    and ZADD in chunks of 1,000 members), a retry not counted as a new URL of its source."""
    from redis import Redis
    redis = Redis.from_url(redis_url, decode_responses=True)
    batch = [FakeMessage(good(n, source=f"s{n % 1500}"), n) for n in range(3000)]
    batch.append(FakeMessage(good(3000, source="again", attempts=1), 3000))
    splitter, *_ = make([batch], redis=redis)
    splitter.split_once(threading.Event())
    assert redis.get(contracts.NUM_SPLIT) == "3001"
    assert redis.scard(contracts.INBOUND_SOURCES) == redis.zcard(contracts.WAITING_SOURCES) == 1501
    assert redis.get(contracts.urls_split_key("s0")) == "2" and redis.get(contracts.urls_split_key("again")) is None
    redis.close()
