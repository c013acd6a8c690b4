"""The scheduler's view of Kafka: one consumer of the ``urls`` topic (and one per wait line).

One consumer with per-partition pause and resume replaces the reference's
consumer per source, so millions of sources cost one group member. Every
call runs on the consumer's own thread (``common.kafka.AsyncConsumer``);
rebalance callbacks, which librdkafka runs on that thread inside
``consume``, only queue events that ``poll`` hands to the event loop.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from confluent_kafka import Consumer, KafkaException, TopicPartition

from common.contracts import EVENT_COMMIT_FAILED, EVENT_CONSUMER_ERROR, EVENT_CONSUMER_FLOW_FAILED
from common.jsonlog import log_event
from common.kafka import AsyncConsumer, coordinates
from worker import metrics
from worker.constants import ASSIGN_OFFSETS_TIMEOUT

TP = tuple[str, int]  # (topic, partition)


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    value: bytes | None
    key: bytes | None = None  # the source, in ``urls``


@dataclass
class Batch:
    records: list[Record] = field(default_factory=list)
    assigned: list[TP] = field(default_factory=list)
    revoked: list[TP] = field(default_factory=list)
    # How long the last assignment took: since the revocation before it, and of that, fetching
    # the committed offsets. Each rebalance stops the worker's reading, so it is logged.
    rebalance: dict[str, float] = field(default_factory=dict)


class Feed(Protocol):
    """What the scheduler needs of its source of URLs (``KafkaFeed``, or a test's fake)."""

    async def subscribe(self, topics: list[str]) -> None: ...
    async def poll(self, max_records: int, timeout: float) -> Batch: ...
    async def pause(self, parts: list[TP]) -> None: ...
    async def resume(self, parts: list[TP]) -> None: ...
    async def commit(self, positions: dict[TP, int]) -> bool: ...
    async def seek(self, positions: dict[TP, int]) -> None: ...
    def offer_positions(self, positions: dict[TP, int]) -> None: ...
    async def close(self) -> None: ...


def start_from_commits(consumer: Consumer, parts: list[TopicPartition]) -> None:
    """Assign the partitions at their committed offsets, or at 0 where the group has none.

    Left to itself librdkafka asks the broker where an uncommitted partition begins
    with one ListOffsets request per partition, which tansu does not answer in time
    for thousands (docs/decisions.md, "Thousands of sources"). One OffsetFetch for them
    all, and 0 for the rest, instead. Offset 0 below the log's start (retention) is
    out of range, which librdkafka resets to the earliest as it would have.
    Runs on the consumer's thread (inside the rebalance callback, or for a share); if the
    broker does not answer, they are assigned without offsets: librdkafka looks them up, the slow way.
    """
    if not parts:
        return
    try:
        positions = consumer.committed(parts, timeout=ASSIGN_OFFSETS_TIMEOUT)
    except KafkaException as exc:
        log_event(EVENT_CONSUMER_ERROR, error=f"committed offsets unknown, librdkafka looks them up: {exc}")
        consumer.assign(parts)  # no offsets: librdkafka asks for the commits itself, the slow way
        return
    for position in positions:
        if position.offset < 0:  # OFFSET_INVALID: nothing committed
            position.offset = 0
    consumer.assign(positions)


def _partitions(consumer: Consumer, topic: str) -> list[int]:
    return sorted(consumer.list_topics(topic, timeout=ASSIGN_OFFSETS_TIMEOUT).topics[topic].partitions)


class KafkaFeed:
    def __init__(self, consumer: AsyncConsumer, group: str, share: tuple[int, int] | None = None):
        """``group``: the consumer's group id, the label of its partitions in worker.metrics.
        ``share``: (index, count) to read the partitions p with p % count == index, without
        joining the group (``URL_PARTITION_SHARE``)."""
        self._consumer = consumer
        self._group = group
        self._share = share
        self._events: deque[tuple[str, list[TP]]] = deque()  # appended on the consumer thread
        self._rebalance: dict[str, float] = {}  # written on the consumer thread, read after consume
        self._revoked_at: float | None = None
        self._subscribed: list[str] | None = None  # the topics
        self._offered: dict[TP, int] = {}  # positions safe to commit, for a revocation

    async def subscribe(self, topics: list[str]) -> None:
        """Subscribe to ``topics``; again to the same ones, nothing (it would rejoin the group):
        the worker subscribes before it has loaded (``worker.intake.group_join``), the scheduler when it runs."""
        if self._subscribed == topics:
            return
        if self._share is not None:
            await self._take_share(topics)
            return

        def note(kind: str, parts: list[TopicPartition]) -> None:
            self._events.append((kind, [(p.topic, p.partition) for p in parts]))

        def revoked(consumer: Consumer, parts: list[TopicPartition]) -> None:
            self._revoked_at = time.monotonic()
            self._commit_before_giving_up(consumer, parts)
            note("revoked", parts)
            metrics.REBALANCE.revoked(self._group, len(parts))

        def assigned(consumer: Consumer, parts: list[TopicPartition]) -> None:
            started = time.monotonic()
            note("assigned", parts)
            metrics.REBALANCE.assigned(self._group, len(parts))
            # A partition paused when it was revoked comes back paused (librdkafka keeps the
            # flag), while the scheduler starts every assigned partition unpaused: it is resumed.
            # Resumed before the assignment, so that its start offset is the newer operation.
            try:
                consumer.resume(parts)
            except KafkaException as exc:  # logged, not raised: the assignment must still happen
                log_event(EVENT_CONSUMER_FLOW_FAILED, action="resume", error=str(exc))
            start_from_commits(consumer, parts)
            done = time.monotonic()
            self._rebalance = {"offsets_seconds": round(done - started, 2)}
            if self._revoked_at is not None:
                self._rebalance["since_revoked_seconds"] = round(done - self._revoked_at, 2)
                self._revoked_at = None
        metrics.REBALANCE.joined(self._group)
        await self._consumer.subscribe(topics, on_assign=assigned, on_revoke=revoked, on_lost=revoked)
        self._subscribed = list(topics)

    async def _take_share(self, topics: list[str]) -> None:
        """Assign this worker's share of the topics' partitions at their commits: no group join to
        wait for (tansu answers one after half the session timeout, 3 s) and no rebalance ever;
        for workers started together by one command, which ends if one dies (docs/decisions.md,
        "The one command")."""
        assert self._share is not None
        index, count = self._share

        def assign(consumer: Consumer) -> list[TopicPartition]:
            parts = [TopicPartition(topic, p) for topic in topics
                     for p in _partitions(consumer, topic)
                     if p % count == index]
            start_from_commits(consumer, parts)
            return parts
        parts = await self._consumer.call(assign)
        self._events.append(("assigned", [(p.topic, p.partition) for p in parts]))
        metrics.REBALANCE.assigned(self._group, len(parts))
        self._subscribed = list(topics)

    async def poll(self, max_records: int, timeout: float) -> Batch:
        if self._subscribed is None:
            await asyncio.sleep(timeout)
            return Batch()
        messages = await self._consumer.consume(max_records, timeout)
        batch = Batch()
        while self._events:
            kind, parts = self._events.popleft()
            getattr(batch, kind).extend(parts)
        if batch.assigned:
            batch.rebalance, self._rebalance = self._rebalance, {}
        for message in messages:
            if message.error():
                log_event(EVENT_CONSUMER_ERROR, error=str(message.error()), topic=message.topic())
                continue
            batch.records.append(Record(*coordinates(message), message.value(), message.key()))
        return batch

    def offer_positions(self, positions: dict[TP, int]) -> None:
        """The positions safe to commit now (``PartitionOffsets.committable``), for a revocation
        before the next commit. Replaced whole: the consumer's thread reads the dict it finds."""
        self._offered = positions

    def _commit_before_giving_up(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        """On the consumer's thread, in the revocation: commit what finished since the last
        commit. After it the group's generation is gone and a commit is refused, and the next
        owner would read it all again. Positions a little stale are only lower, never past an
        unfinished URL."""
        offered = self._offered
        positions = [TopicPartition(p.topic, p.partition, offered[(p.topic, p.partition)])
                     for p in parts if (p.topic, p.partition) in offered]
        if not positions:
            return
        try:
            consumer.commit(offsets=positions, asynchronous=False)
        except KafkaException as exc:  # the group moved on already: the next owner reads them again
            log_event(EVENT_COMMIT_FAILED, error=str(exc), partitions=len(positions), at="revocation")

    async def pause(self, parts: list[TP]) -> None:
        await self._flow("pause", parts)

    async def resume(self, parts: list[TP]) -> None:
        await self._flow("resume", parts)

    async def _flow(self, action: str, parts: list[TP]) -> None:
        if not parts:
            return
        try:
            await self._consumer.call(lambda c: getattr(c, action)([TopicPartition(t, p) for t, p in parts]))
        except KafkaException as exc:  # e.g. a partition revoked in the meantime
            log_event(EVENT_CONSUMER_FLOW_FAILED, action=action, error=str(exc))

    async def seek(self, positions: dict[TP, int]) -> None:
        """Read each partition again from ``position`` (it must be assigned to this consumer)."""
        await self._consumer.seek(positions)

    async def commit(self, positions: dict[TP, int]) -> bool:
        """Commit each partition's position (the next offset to read); False if the broker refused."""
        try:
            await self._consumer.commit_offsets([TopicPartition(t, p, o) for (t, p), o in positions.items()])
            return True
        except KafkaException as exc:  # a rebalance in progress: the next commit retries
            log_event(EVENT_COMMIT_FAILED, error=str(exc), partitions=len(positions))
            return False

    async def close(self) -> None:
        await self._consumer.close()
