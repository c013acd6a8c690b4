"""The collector's I/O: outcome messages from Kafka, and the sites' limits from Redis.

Kafka's calls block, so ``KafkaOutcomes`` is only ever called from the collector's one
Kafka thread. It reads the output topics with assigned partitions (no group, nothing
committed: tansu drops commit metadata), from the offsets the collector saved, or on a
fresh run from the run's start (``offsets_for_times``; the partition's start where the
broker cannot say).
"""
from __future__ import annotations

import time
from typing import Any, NamedTuple, Protocol

from confluent_kafka import Consumer, KafkaException, TopicPartition

from common import contracts
from common.contracts import INBOUND_PARTITIONS
from common.jsonlog import log_event
from common.kafka import consumer_config, ensure_topics
from common.offset_gaps import OffsetGaps, assigned_at, consume_whole

DATASET_GROUP = "image_crawler_dataset"  # never joined nor committed to: partitions are assigned
WATERMARK_TIMEOUT = 10.0


class Record(NamedTuple):
    topic: str
    partition: int
    offset: int
    value: bytes | None


def partition_name(topic: str, partition: int) -> str:
    return f"{topic}:{partition}"


class OutcomeSource(Protocol):
    def start(self, saved: dict[str, int], since: float) -> dict[str, int]:
        """Read each partition from its ``saved`` offset, or from Unix time ``since``; the offsets started at."""
    def poll(self, max_messages: int, timeout: float) -> list[Record]: ...
    def close(self) -> None: ...


class KafkaOutcomes:
    def __init__(self, hosts: str, topics: tuple[str, ...]):
        ensure_topics(hosts, topics, INBOUND_PARTITIONS)
        self._topics = topics
        self._consumer = Consumer(consumer_config(hosts, DATASET_GROUP))
        self._gaps = OffsetGaps()

    def start(self, saved: dict[str, int], since: float) -> dict[str, int]:
        metadata = self._consumer.list_topics(timeout=WATERMARK_TIMEOUT)
        partitions = [TopicPartition(topic, p) for topic in self._topics
                      for p in sorted(metadata.topics[topic].partitions)]
        missing = [tp for tp in partitions if partition_name(tp.topic, tp.partition) not in saved]
        found = self._offsets_since(missing, since) if missing else {}
        starts = {}
        for tp in partitions:
            name = partition_name(tp.topic, tp.partition)
            starts[name] = saved[name] if name in saved else found[name]
        assignment = [TopicPartition(tp.topic, tp.partition, starts[partition_name(tp.topic, tp.partition)])
                      for tp in partitions]
        self._consumer.assign(assignment)
        assigned_at(self._gaps, assignment)
        return starts

    def _offsets_since(self, partitions: list[TopicPartition], since: float) -> dict[str, int]:
        """The first offset at or after ``since`` in each partition: its end if it has none yet."""
        # The watermarks first: a message produced after them is read, whatever the lookup says.
        marks = {partition_name(tp.topic, tp.partition): self._consumer.get_watermark_offsets(
            tp, timeout=WATERMARK_TIMEOUT) for tp in partitions}
        asked = [TopicPartition(tp.topic, tp.partition, int(since * 1000)) for tp in partitions]
        try:
            answers = {partition_name(tp.topic, tp.partition): tp.offset
                       for tp in self._consumer.offsets_for_times(asked, timeout=WATERMARK_TIMEOUT)}
        except KafkaException as exc:
            log_event(contracts.EVENT_DATASET_OFFSETS_BY_TIME, error=str(exc)[:300])
            answers = {}
        out = {}
        for tp in partitions:
            name = partition_name(tp.topic, tp.partition)
            low, high = marks[name]
            answer = answers.get(name)
            out[name] = low if answer is None else (high if answer < 0 else max(low, answer))
        return out

    def poll(self, max_messages: int, timeout: float) -> list[Record]:
        records = []
        for message in consume_whole(self._consumer, self._gaps, max_messages, timeout):
            topic, partition, offset = message.topic(), message.partition(), message.offset()
            if message.error() is not None or topic is None or partition is None or offset is None:
                continue
            records.append(Record(topic, partition, offset, message.value()))
        return records

    def close(self) -> None:
        self._consumer.close()


class LimitSource(Protocol):
    async def limit_sum(self) -> float | None:
        """The sum of the limits (req/s) of the sites being crawled now; None if unknown."""
    async def close(self) -> None: ...


ACTIVE_WINDOW = 30.0  # seconds: the monitor grants tokens to the sources active within this


class RedisLimits:
    """The monitor's view (SPEC.md §2): ``active_sources`` recent within 30 s, each one's
    limit in ``adaptive:{source}`` ``ceiling`` (the computed or overridden rate)."""

    def __init__(self, redis: Any):
        self._redis = redis

    async def limit_sum(self) -> float | None:
        sources = await self._redis.zrangebyscore(contracts.ACTIVE_SOURCES, time.time() - ACTIVE_WINDOW, "+inf")
        if not sources:
            return None
        async with self._redis.pipeline(transaction=False) as pipe:
            for source in sources:
                pipe.hget(contracts.adaptive_key(source), contracts.ADAPTIVE_CEILING_FIELD)
            ceilings = await pipe.execute()
        total = 0.0
        for value in ceilings:
            try:
                total += float(value) if value is not None else 0.0
            except ValueError:
                continue
        return total or None

    async def close(self) -> None:
        await self._redis.aclose()
