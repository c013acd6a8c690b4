"""The worker's Kafka feed on the real broker: new partitions start at the group's commits, or
at 0, unpaused, and each assignment says how long it took (worker_partitions) and shows in
the worker's /metrics (partitions owned, rebalances)."""
from __future__ import annotations

import asyncio
import json

from confluent_kafka import Consumer, Producer, TopicPartition

from common.kafka import AsyncConsumer, consumer_config, ensure_topics, producer_config
from worker.constants import CONSUMER_EXTRA_CONFIG
from worker.intake.feed import KafkaFeed
from worker.metrics import REGISTRY


def three_in_each_of_four(kafka_hosts: str, topic: str, group: str, committed: int) -> None:
    """``topic`` with 3 messages in each of its 4 partitions; ``group`` has committed offset 2
    of partition ``committed``."""
    ensure_topics(kafka_hosts, [topic], 4)
    producer = Producer(producer_config(kafka_hosts))
    for partition in range(4):
        for n in range(3):
            producer.produce(topic, json.dumps({"p": partition, "n": n}).encode(), partition=partition)
    assert producer.flush(30) == 0
    earlier = Consumer(consumer_config(kafka_hosts, group))
    earlier.commit(offsets=[TopicPartition(topic, committed, 2)], asynchronous=False)
    earlier.close()


async def test_assigned_partitions_start_at_their_commit_or_at_the_beginning(kafka_hosts: str, unique: str) -> None:
    topic, group = f"urls.feed{unique}", f"feed-{unique}"
    three_in_each_of_four(kafka_hosts, topic, group, committed=2)  # another worker finished 2 up to offset 2

    consumer = AsyncConsumer(consumer_config(kafka_hosts, group, **CONSUMER_EXTRA_CONFIG))
    feed = KafkaFeed(consumer, group)
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


async def two_partitions_of_four(kafka_hosts: str, topic: str, group: str) -> tuple[AsyncConsumer, KafkaFeed]:
    """``topic`` with 4 messages in each of its 2 partitions (and ``{topic}b``, empty, to subscribe
    to later: an eager rebalance), and a feed of ``group`` subscribed to it."""
    ensure_topics(kafka_hosts, [topic, f"{topic}b"], 2)
    producer = Producer(producer_config(kafka_hosts))
    for partition in range(2):
        for n in range(4):
            producer.produce(topic, json.dumps({"p": partition, "n": n}).encode(), partition=partition)
    assert producer.flush(30) == 0
    consumer = AsyncConsumer(consumer_config(kafka_hosts, group, **CONSUMER_EXTRA_CONFIG))
    feed = KafkaFeed(consumer, group)
    await feed.subscribe([topic])
    return consumer, feed


async def test_a_partition_paused_at_a_rebalance_is_read_again_from_its_commit(kafka_hosts: str, unique: str) -> None:
    # librdkafka keeps a partition's pause across a revoke and re-assignment; the scheduler
    # starts every assigned partition unpaused, so a source paused at that moment was never
    # read again (issue 20). What it had read but not finished comes again from the commit.
    topic, group = f"urls.paused{unique}", f"paused-{unique}"
    consumer, feed = await two_partitions_of_four(kafka_hosts, topic, group)
    before: list[tuple[int, int]] = []
    after: list[tuple[int, int]] = []
    timings: list[dict[str, float]] = []  # each assignment's, for worker_partitions
    try:
        async with asyncio.timeout(60):
            while len(before) < 8:
                batch = await feed.poll(100, 0.2)
                before += [(record.partition, record.offset) for record in batch.records]
                timings += [batch.rebalance] if batch.assigned else []
            assert await feed.commit({(topic, 0): 1, (topic, 1): 3})  # the rest was unfinished
            await feed.pause([(topic, 0), (topic, 1)])
            await feed.subscribe([topic, f"{topic}b"])  # an eager rebalance: revoked, then assigned again
            while len(after) < 4 or len(timings) < 2:
                batch = await feed.poll(100, 0.2)
                after += [(record.partition, record.offset) for record in batch.records if record.topic == topic]
                timings += [batch.rebalance] if batch.assigned else []
            owned = REGISTRY.get_sample_value("crawler_worker_partitions", {"group": group})
            rebalances = REGISTRY.get_sample_value("crawler_worker_rebalances_total", {"group": group})
            since = REGISTRY.get_sample_value("crawler_worker_seconds_since_rebalance", {"group": group})
    finally:
        await consumer.close()
    assert (owned, rebalances) == (4, 2)  # both topics' partitions, after the second assignment
    assert since is not None and 0 <= since < 60
    assert sorted(after) == [(0, 1), (0, 2), (0, 3), (1, 3)]
    first, second = timings
    assert set(first) == {"offsets_seconds"} and first["offsets_seconds"] >= 0
    assert second["since_revoked_seconds"] >= second["offsets_seconds"] >= 0


async def test_what_finished_after_the_last_commit_is_committed_when_the_partition_is_revoked(
        kafka_hosts: str, unique: str) -> None:
    """A revocation takes the group's generation with it, and a commit after it is refused: the
    positions offered since the last commit are committed in the revocation itself, so the
    next owner does not crawl them again."""
    topic, group = f"urls.revoked{unique}", f"revoked-{unique}"
    consumer, feed = await two_partitions_of_four(kafka_hosts, topic, group)
    before: list[tuple[int, int]] = []
    after: list[tuple[int, int]] = []
    assignments = 0
    try:
        async with asyncio.timeout(60):
            while len(before) < 8:
                batch = await feed.poll(100, 0.2)
                before += [(record.partition, record.offset) for record in batch.records]
                assignments += bool(batch.assigned)
            assert await feed.commit({(topic, 0): 1, (topic, 1): 1})
            feed.offer_positions({(topic, 0): 3, (topic, 1): 4})  # finished since, not committed yet
            await feed.subscribe([topic, f"{topic}b"])  # an eager rebalance: revoked, then assigned again
            while assignments < 2 or len(after) < 1:
                batch = await feed.poll(100, 0.2)
                after += [(record.partition, record.offset) for record in batch.records if record.topic == topic]
                assignments += bool(batch.assigned)
            await asyncio.sleep(1)  # nothing more comes
            batch = await feed.poll(100, 0.5)
            after += [(record.partition, record.offset) for record in batch.records if record.topic == topic]
    finally:
        await consumer.close()
    assert sorted(after) == [(0, 3)]


async def test_a_share_reads_its_partitions_from_their_commits_without_a_group_join(kafka_hosts: str,
                                                                                     unique: str) -> None:
    topic, group = f"urls.share{unique}", f"share-{unique}"
    three_in_each_of_four(kafka_hosts, topic, group, committed=3)
    read: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    assigned: dict[int, list] = {0: [], 1: []}
    feeds = []
    for index in (0, 1):
        consumer = AsyncConsumer(consumer_config(kafka_hosts, group, **CONSUMER_EXTRA_CONFIG))
        feeds.append((consumer, KafkaFeed(consumer, group, share=(index, 2))))
    try:
        for _, feed in feeds:
            await feed.subscribe([topic])
        async with asyncio.timeout(30):
            while len(read[0]) + len(read[1]) < 10:
                for index, (_, feed) in enumerate(feeds):
                    batch = await feed.poll(100, 0.1)
                    assigned[index] += batch.assigned
                    read[index] += [(record.partition, record.offset) for record in batch.records]
        assert await feeds[1][1].commit({(topic, 1): 3})
    finally:
        for consumer, _ in feeds:
            await consumer.close()
    assert sorted(assigned[0]) == [(topic, 0), (topic, 2)] and sorted(assigned[1]) == [(topic, 1), (topic, 3)]
    assert sorted(read[0]) == [(p, n) for p in (0, 2) for n in range(3)]
    assert sorted(read[1]) == [(1, 0), (1, 1), (1, 2), (3, 2)]
    later = Consumer(consumer_config(kafka_hosts, group))
    assert later.committed([TopicPartition(topic, 1)], timeout=10)[0].offset == 3
    later.close()
