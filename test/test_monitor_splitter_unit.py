"""The splitter's batch step on fakes: routing, and commit only after every delivery."""
from __future__ import annotations

import json
import threading

import pytest
from confluent_kafka import KafkaError, KafkaException

from common import contracts
from crawl_monitor.constants import TOPIC_CREATE_BATCH
from crawl_monitor.splitter import Splitter, Stopping, plan_batch
from test.test_monitor_fakes import FakeConsumer, FakeMessage, FakeProducer, FakeRedis


def good(n: int, source: str = "Example") -> bytes:
    return json.dumps({"url": f"https://example.org/{n}.jpg", "uuid": f"u-{n}", "source": source}).encode()


def make(batches, producer=None, redis=None):
    consumer = FakeConsumer(batches)
    producer = producer or FakeProducer()
    redis = redis or FakeRedis()
    created: list[list[str]] = []

    def create(topics: list[str]) -> dict[str, KafkaError]:
        created.append(topics)
        return {}

    splitter = Splitter(consumer, producer, redis, create, inbound_topic="inbound")
    return splitter, consumer, producer, redis, created


def test_plan_routes_each_message_and_commits_past_the_last_offset_per_partition() -> None:
    messages = [FakeMessage(good(1, "Flickr"), 10), FakeMessage(b"{not json", 11),
                FakeMessage(good(2, "met"), 5, partition=1), FakeMessage(None, 12),
                FakeMessage(None, -1, error="broker hiccup"), FakeMessage(b"[" * 100_000, 13)]
    plan = plan_batch(messages, "inbound")
    topics = [topic for topic, _, _ in plan.records]
    assert topics == ["urls.flickr", contracts.REJECTED_TOPIC, "urls.met"] + [contracts.REJECTED_TOPIC] * 2
    assert json.loads(plan.records[0][2])["source"] == "flickr" and plan.records[0][1] == "u-1"
    rejected = json.loads(plan.records[1][2])
    assert rejected["topic"] == "inbound" and rejected["raw"] == "{not json"
    assert rejected["error"].startswith("not JSON")
    assert json.loads(plan.records[4][2])["error"].startswith("not JSON: RecursionError")  # deep nesting
    assert (plan.split, plan.rejected, plan.sources) == (2, 3, {"flickr", "met"})
    assert sorted((tp.topic, tp.partition, tp.offset) for tp in plan.offsets) == [("inbound", 0, 14), ("inbound", 1, 6)]


def test_a_batch_is_produced_recorded_then_committed() -> None:
    splitter, consumer, producer, redis, created = make([[FakeMessage(good(n), n) for n in range(3)]])
    assert splitter.split_once(threading.Event()) == 3
    assert [topic for topic, _, _ in producer.delivered] == ["urls.example"] * 3
    assert created == [["urls.example"]]
    assert consumer.commits == [[("inbound", 0, 3)]]
    assert redis.smembers(contracts.INBOUND_SOURCES) == {"example"} and redis.get(contracts.NUM_SPLIT) == "3"


def test_topics_are_created_once_per_process() -> None:
    splitter, _, _, _, created = make([[FakeMessage(good(1), 1)], [FakeMessage(good(2), 2)]])
    splitter.split_once(threading.Event())
    splitter.split_once(threading.Event())
    assert created == [["urls.example"]]


def test_failed_deliveries_are_resent_before_the_commit() -> None:
    producer = FakeProducer(fail_first=2, buffer_errors=3)
    splitter, consumer, _, _, _ = make([[FakeMessage(good(n), n) for n in range(5)]], producer=producer)
    splitter.split_once(threading.Event())
    assert sorted(key for _, key, _ in producer.delivered) == [f"u-{n}" for n in range(5)]
    assert consumer.commits == [[("inbound", 0, 5)]]


def test_messages_that_timed_out_in_the_queue_are_resent(capsys) -> None:
    """librdkafka reports a message that never reached the broker with no partition or offset;
    reading its coordinates raised, and the whole batch was produced again (seen at 5,000 sources)."""
    producer = FakeProducer(fail_first=2, failed_offset=None)
    splitter, consumer, _, _, _ = make([[FakeMessage(good(n), n) for n in range(5)]], producer=producer)
    splitter.split_once(threading.Event())
    assert sorted(key for _, key, _ in producer.delivered) == [f"u-{n}" for n in range(5)]  # once each
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


def test_a_topic_kafka_refuses_sends_its_messages_to_rejected_and_the_rest_on() -> None:
    def create(topics: list[str]) -> dict[str, KafkaError]:
        refused = KafkaError(KafkaError.TOPIC_EXCEPTION, "collides with urls.a_b")
        return {topic: refused for topic in topics if topic == "urls.a.b"}

    batch = [FakeMessage(good(1, "a.b"), 1), FakeMessage(good(2, "fine"), 2), FakeMessage(good(3, "a.b"), 3)]
    consumer, producer, redis = FakeConsumer([batch, [FakeMessage(good(4, "a.b"), 4)]]), FakeProducer(), FakeRedis()
    splitter = Splitter(consumer, producer, redis, create, inbound_topic="inbound")
    assert splitter.split_once(threading.Event()) == 1
    assert splitter.split_once(threading.Event()) == 0
    assert [topic for topic, _, _ in producer.delivered] == [
        contracts.REJECTED_TOPIC, "urls.fine", contracts.REJECTED_TOPIC, contracts.REJECTED_TOPIC]
    assert "refuses topic urls.a.b" in json.loads(producer.delivered[0][2])["error"]
    assert redis.smembers(contracts.INBOUND_SOURCES) == {"fine"} and redis.get(contracts.NUM_SPLIT) == "1"
    assert consumer.commits == [[("inbound", 0, 4)], [("inbound", 0, 5)]]


def test_a_broker_that_is_away_during_topic_creation_retries_the_batch(monkeypatch) -> None:
    attempts = []

    def create(topics: list[str]) -> dict[str, KafkaError]:
        attempts.append(topics)
        if len(attempts) == 1:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "broker down"))
        return {}

    monkeypatch.setattr(threading.Event, "wait", lambda self, timeout=None: self.is_set())
    consumer, producer, redis = FakeConsumer([[FakeMessage(good(1), 1)]]), FakeProducer(), FakeRedis()
    Splitter(consumer, producer, redis, create, inbound_topic="inbound").split_once(threading.Event())
    assert attempts == [["urls.example"], ["urls.example"]]
    assert [topic for topic, _, _ in producer.delivered] == ["urls.example"]


def test_new_topics_are_created_many_per_request_whatever_the_number_of_sources() -> None:
    """Issue 20: a request (and an admin client) per topic made 5,000 sources take minutes."""
    batch = [FakeMessage(good(n, f"s{n:04d}"), n) for n in range(1200)]
    splitter, consumer, producer, _, created = make([batch])
    assert splitter.split_once(threading.Event()) == 1200
    assert [len(topics) for topics in created] == [TOPIC_CREATE_BATCH, TOPIC_CREATE_BATCH, 200]
    assert len({topic for topic, _, _ in producer.delivered}) == 1200 and consumer.commits


def test_a_topic_the_broker_could_not_create_yet_retries_only_what_is_missing(monkeypatch) -> None:
    attempts = []

    def create(topics: list[str]) -> dict[str, KafkaError]:
        attempts.append(topics)
        late = KafkaError(KafkaError.REQUEST_TIMED_OUT, "timed out")
        return {"urls.b": late} if len(attempts) == 1 else {}

    monkeypatch.setattr(threading.Event, "wait", lambda self, timeout=None: self.is_set())
    batch = [FakeMessage(good(1, "a"), 1), FakeMessage(good(2, "b"), 2)]
    consumer, producer, redis = FakeConsumer([batch]), FakeProducer(), FakeRedis()
    Splitter(consumer, producer, redis, create, inbound_topic="inbound").split_once(threading.Event())
    assert attempts == [["urls.a", "urls.b"], ["urls.b"]]
    assert sorted(topic for topic, _, _ in producer.delivered) == ["urls.a", "urls.b"]
    assert consumer.commits == [[("inbound", 0, 3)]]


def test_a_stop_while_topics_are_created_leaves_the_batch_uncommitted() -> None:
    """The splitter stops between two creation requests, not after every topic of the batch."""
    stop = threading.Event()
    created: list[list[str]] = []

    def create(topics: list[str]) -> dict[str, KafkaError]:
        created.append(topics)
        stop.set()
        return {}

    batch = [FakeMessage(good(n, f"s{n:04d}"), n) for n in range(3 * TOPIC_CREATE_BATCH)]
    consumer, producer, redis = FakeConsumer([batch]), FakeProducer(), FakeRedis()
    with pytest.raises(Stopping):
        Splitter(consumer, producer, redis, create, inbound_topic="inbound").split_once(stop)
    assert len(created) == 1 and consumer.commits == [] and producer.delivered == []


class RefusingProducer(FakeProducer):
    """The broker refuses every message whose value holds ``marker`` (as too large), every time."""

    def __init__(self, marker: bytes, refuse_rejections: bool = False):
        super().__init__()
        self.marker, self.refuse_rejections = marker, refuse_rejections

    def flush(self, timeout: float = 0) -> int:
        queued, self.queued = self.queued, []
        for topic, key, value, on_delivery in queued:
            if self.marker in value and (topic != contracts.REJECTED_TOPIC or self.refuse_rejections):
                on_delivery(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), FakeMessage(value, -1, topic, key=key))
            else:
                self.delivered.append((topic, key, value))
        return 0


@pytest.mark.parametrize("refuse_rejections", [False, True])
def test_a_message_the_broker_refuses_is_rejected_not_resent_forever(capsys, refuse_rejections: bool) -> None:
    """Resending it would get the same answer and hold the batch (and every source) forever."""
    producer = RefusingProducer(b"u-2", refuse_rejections)
    splitter, consumer, _, redis, _ = make([[FakeMessage(good(n), n) for n in range(4)]], producer=producer)
    assert splitter.split_once(threading.Event()) == 3
    assert sorted(key for topic, key, _ in producer.delivered if topic == "urls.example") == ["u-0", "u-1", "u-3"]
    rejected = [json.loads(value) for topic, _, value in producer.delivered if topic == contracts.REJECTED_TOPIC]
    if refuse_rejections:
        assert rejected == [] and "the rejection is lost" in capsys.readouterr().out
    else:
        (record,) = rejected
        assert json.loads(record["raw"])["uuid"] == "u-2" and "MSG_SIZE_TOO_LARGE" in record["error"]
    assert consumer.commits == [[("inbound", 0, 4)]] and redis.get(contracts.NUM_SPLIT) == "3"
