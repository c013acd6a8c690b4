"""The worker's Kafka feed on the real broker: new partitions start at the group's commits, or at 0."""
from __future__ import annotations

import asyncio
import json

from confluent_kafka import Consumer, Producer, TopicPartition

from common.kafka import AsyncConsumer, consumer_config, ensure_topics, producer_config
from worker.constants import CONSUMER_EXTRA_CONFIG
from worker.feed import KafkaFeed, start_from_commits


async def test_assigned_partitions_start_at_their_commit_or_at_the_beginning(kafka_hosts: str, unique: str) -> None:
    topic, group = f"urls.feed{unique}", f"feed-{unique}"
    ensure_topics(kafka_hosts, [topic], 4)
    producer = Producer(producer_config(kafka_hosts))
    for partition in range(4):
        for n in range(3):
            producer.produce(topic, json.dumps({"p": partition, "n": n}).encode(), partition=partition)
    assert producer.flush(30) == 0
    # The group finished partition 2 up to offset 2 earlier (another worker, say).
    earlier = Consumer(consumer_config(kafka_hosts, group))
    earlier.commit(offsets=[TopicPartition(topic, 2, 2)], asynchronous=False)
    earlier.close()

    consumer = AsyncConsumer(consumer_config(kafka_hosts, group, **CONSUMER_EXTRA_CONFIG))
    feed = KafkaFeed(consumer)
    await feed.subscribe([topic])
    read: list[tuple[int, int]] = []
    try:
        async with asyncio.timeout(60):
            while len(read) < 10:
                batch = await feed.poll(100, 0.2)
                read += [(record.partition, record.offset) for record in batch.records]
    finally:
        await consumer.close()
    assert sorted(read) == sorted([(p, n) for p in (0, 1, 3) for n in range(3)] + [(2, 2)])


def test_partitions_this_worker_knew_start_where_it_left_them_without_asking_the_broker() -> None:
    """Issue 20: every subscription change reassigns every partition (round-robin is eager);
    asking the broker for 10,000 commits each time stalled reading for seconds."""

    class Recording:
        def __init__(self) -> None:
            self.asked: list[tuple[str, int]] = []
            self.assigned: list[TopicPartition] = []

        def committed(self, parts: list[TopicPartition], timeout: float) -> list[TopicPartition]:
            self.asked += [(p.topic, p.partition) for p in parts]
            return [TopicPartition(p.topic, p.partition, 7 if p.partition == 1 else -1001) for p in parts]

        def assign(self, parts: list[TopicPartition]) -> None:
            self.assigned = parts

    consumer, known = Recording(), {("urls.a", 0): 42}
    parts = [TopicPartition("urls.a", n) for n in range(3)]
    start_from_commits(consumer, parts, known)  # type: ignore[arg-type]
    assert consumer.asked == [("urls.a", 1), ("urls.a", 2)]
    assert [(p.partition, p.offset) for p in consumer.assigned] == [(0, 42), (1, 7), (2, 0)]
    consumer.asked.clear()
    start_from_commits(consumer, parts, known)  # type: ignore[arg-type]
    assert consumer.asked == [] and [p.offset for p in consumer.assigned] == [42, 7, 0]
