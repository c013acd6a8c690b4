"""What a run left on the broker: its topics' partitions and how many messages each topic
took (high watermarks), for the benchmarks that compare topic layouts."""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from common.kafka import client_config, consumer_config

TIMEOUT = 120.0


def topic_partitions(hosts: str) -> dict[str, int]:
    """Every topic the broker lists, with its partition count (one metadata request)."""
    metadata = AdminClient(client_config(hosts)).list_topics(timeout=TIMEOUT)
    return {name: len(topic.partitions) for name, topic in metadata.topics.items()}


def messages_written(hosts: str, partitions: dict[str, int]) -> dict[str, int]:
    """Messages each topic holds: the sum of its partitions' high watermarks (nothing is
    deleted during a run).

    tansu's ListOffsets answers the base offset of a partition's last batch plus one, not
    its high watermark (3 for a partition of offsets 0-2 then 3-7), while its fetch
    answers carry the right one. So each non-empty partition is read from that answer
    minus one, which is at most its last batch, up to its end (librdkafka's partition
    EOF carries the high watermark). On a broker that answers right, that is one message.
    """
    if not partitions:
        return {}
    admin = AdminClient(client_config(hosts))
    request = {TopicPartition(topic, p): OffsetSpec.latest() for topic, n in partitions.items() for p in range(n)}
    listed = {(part.topic, part.partition): future.result().offset
              for part, future in admin.list_offsets(request, request_timeout=TIMEOUT).items()}
    written = dict.fromkeys(partitions, 0)
    unread = {tp: offset for tp, offset in listed.items() if offset > 0}
    consumer = Consumer(consumer_config(hosts, f"bench-watermarks-{uuid.uuid4().hex[:8]}",
                                        **{"enable.partition.eof": True}))
    try:
        consumer.assign([TopicPartition(topic, p, offset - 1) for (topic, p), offset in unread.items()])
        deadline = time.monotonic() + TIMEOUT
        while unread and time.monotonic() < deadline:
            for message in consumer.consume(10_000, 1.0):
                error = message.error()
                if error is not None and error.code() == KafkaError._PARTITION_EOF:
                    tp = (message.topic(), message.partition())
                    if unread.pop(tp, None) is not None:
                        written[tp[0]] += message.offset()
    finally:
        consumer.close()
    if unread:
        raise TimeoutError(f"{len(unread)} partitions did not reach their end in {TIMEOUT:.0f} s")
    return written


def grouped(counts: dict[str, int], group_of: Callable[[str], str | None]) -> dict[str, tuple[int, int]]:
    """``counts`` summed by ``group_of(topic)`` (None: left out): {group: (topics, sum)}."""
    groups: dict[str, tuple[int, int]] = {}
    for topic, count in sorted(counts.items()):
        group = group_of(topic)
        if group is not None:
            topics, total = groups.get(group, (0, 0))
            groups[group] = (topics + 1, total + count)
    return groups
