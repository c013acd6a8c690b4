"""What a run left on the broker: its topics' partitions and their messages, for the
benchmarks that compare topic layouts."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient

from common.kafka import client_config, consumer_config

TIMEOUT = 120.0


def topic_partitions(hosts: str) -> dict[str, int]:
    """Every topic the broker lists, with its partition count (one metadata request)."""
    metadata = AdminClient(client_config(hosts)).list_topics(timeout=TIMEOUT)
    return {name: len(topic.partitions) for name, topic in metadata.topics.items()}


def read_all(hosts: str, partitions: dict[str, int], tally: Callable[[str, bytes], None]) -> None:
    """Hand every message of these topics, from their start to their end, to ``tally(topic, value)``:
    to tell whose messages a topic holds (a few seconds for a few hundred thousand).

    Counting them is also the one sure way to know how many a topic holds on tansu: its
    ListOffsets answers a partition's last batch's base offset + 1, not its high watermark
    (4 for offsets 0-2 then 3-7); librdkafka's partition EOF, from the fetch, is right."""
    consumer = Consumer(consumer_config(hosts, f"bench-read-all-{uuid.uuid4().hex[:8]}",
                                        **{"enable.partition.eof": True}))
    unread = {(topic, p) for topic, n in partitions.items() for p in range(n)}
    try:
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for topic, p in unread])
        deadline = time.monotonic() + TIMEOUT
        while unread and time.monotonic() < deadline:
            for message in consumer.consume(10_000, 1.0):
                error = message.error()
                if error is None:
                    tally(message.topic(), message.value())
                elif error.code() == KafkaError._PARTITION_EOF:
                    unread.discard((message.topic(), message.partition()))
    finally:
        consumer.close()
    if unread:
        raise TimeoutError(f"{len(unread)} partitions did not reach their end in {TIMEOUT:.0f} s")
