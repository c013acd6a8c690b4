"""The splitter: ``inbound_images`` fanned out to one ``urls.{source}`` topic per source.

Workers pull from each source separately so that a slow source never starves
the others. Throughput comes from batches: one consume of thousands of
messages, one flush, one commit, one Redis pipeline. The inbound offsets are
committed only once every message of the batch is acknowledged by the broker,
so a crash anywhere before the commit re-splits the batch (at-least-once)
instead of losing it. The whole loop runs on its own thread: every Kafka call
blocks, and none of them may stall the monitor's event loop.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from redis import Redis

from common import contracts
from common.jsonlog import log_event
from common.kafka import (TopicCreator, consumer_config, coordinates, produce_waiting, producer_config,
                          refuses_the_message)
from common.settings import Settings
from common.protocols import SyncRedis
from crawl_monitor.constants import (SPLIT_BATCH_SIZE, SPLIT_FLUSH_SECONDS, SPLIT_MAX_BACKOFF_SECONDS,
                                     SPLIT_PARTITION_CHECK_SECONDS, SPLIT_POLL_SECONDS, TOPIC_CREATE_BATCH)

Record = tuple[str, Any, bytes]  # topic, key, value
_REFUSED_TOPIC_ERRORS = frozenset({KafkaError.TOPIC_EXCEPTION, KafkaError.POLICY_VIOLATION})


def _report(error: str, **fields: Any) -> None:
    log_event(contracts.EVENT_MONITOR_COMPONENT_ERROR, component="splitter", error=error, **fields)


class Stopping(Exception):
    """Asked to stop before the batch was done: it stays uncommitted and is re-split later."""


@dataclass
class SplitPlan:
    """Where each message of one consumed batch goes, and the offsets that batch commits."""

    records: list[Record] = field(default_factory=list)
    sources: set[str] = field(default_factory=set)
    split: int = 0
    rejected: int = 0
    first_rejection: str = ""
    offsets: list[TopicPartition] = field(default_factory=list)


def plan_batch(messages: Iterable[Message], inbound_topic: str) -> SplitPlan:
    """Validate each message and route it: its source's topic, or ``rejected_messages`` with the reason."""
    plan = SplitPlan()
    next_offsets: dict[tuple[str, int], int] = {}
    for message in messages:
        if message.error() is not None:
            _report(str(message.error()))
            continue
        topic, partition, offset = coordinates(message)
        next_offsets[(topic, partition)] = offset + 1
        raw = message.value()
        try:
            request = contracts.parse_crawl_request(raw)
        except contracts.InvalidMessage as exc:
            reason = str(exc)
        except Exception as exc:  # noqa: BLE001 - e.g. RecursionError on deep nesting: still bad input
            reason = f"cannot be parsed: {type(exc).__name__}"
        else:
            # Keyed by uuid: a source's URLs spread over all its partitions, hence over all workers.
            plan.records.append((contracts.source_topic(request.source), request.uuid, request.to_json()))
            plan.sources.add(request.source)
            plan.split += 1
            continue
        plan.records.append((contracts.REJECTED_TOPIC, None, contracts.rejected_message(inbound_topic, raw, reason)))
        plan.rejected += 1
        plan.first_rejection = plan.first_rejection or reason
    plan.offsets = [TopicPartition(topic, partition, offset)
                    for (topic, partition), offset in next_offsets.items()]
    return plan


class Splitter:
    """One consumer, one producer and a Redis client, driven batch by batch from one thread."""

    def __init__(self, consumer: Consumer, producer: Producer, redis: SyncRedis,
                 create_topics: Callable[[list[str]], dict[str, KafkaError]], *,
                 inbound_topic: str = contracts.INBOUND_TOPIC, batch_size: int = SPLIT_BATCH_SIZE,
                 poll_seconds: float = SPLIT_POLL_SECONDS):
        self._consumer = consumer
        self._producer = producer
        self._redis = redis
        self._create_topics = create_topics
        self._inbound_topic = inbound_topic
        self._batch_size = batch_size
        self._poll_seconds = poll_seconds
        self._ready_topics = {contracts.REJECTED_TOPIC}
        self._refused: dict[str, str] = {}  # topic -> why Kafka will not create it
        self._assigned: set[int] = set()     # inbound partitions being read

    def run(self, stop: threading.Event) -> None:
        checked = time.monotonic()
        while not stop.is_set():
            self.split_once(stop)
            if time.monotonic() - checked > SPLIT_PARTITION_CHECK_SECONDS:
                self.assign_new_partitions()
                checked = time.monotonic()

    def assign_new_partitions(self) -> None:
        """Read every partition of the inbound topic, including any an operator added since."""
        metadata = self._consumer.list_topics(self._inbound_topic, timeout=SPLIT_FLUSH_SECONDS)
        topic = metadata.topics[self._inbound_topic]
        if topic.error is not None:
            raise KafkaException(topic.error)
        new = sorted(set(topic.partitions) - self._assigned)
        if new:
            # No offset given: each starts from the group's committed offset (else the earliest).
            self._consumer.incremental_assign([TopicPartition(self._inbound_topic, p) for p in new])
            self._assigned.update(new)

    def split_once(self, stop: threading.Event) -> int:
        """Split one batch; return how many messages went to source topics."""
        messages = self._consumer.consume(num_messages=self._batch_size, timeout=self._poll_seconds)
        if not messages:
            return 0
        plan = plan_batch(messages, self._inbound_topic)
        self._retry_until_done(lambda: self._deliver(plan, stop), stop)
        self._retry_until_done(lambda: self._record(plan), stop)
        self._commit(plan.offsets)
        if plan.rejected:
            log_event(contracts.EVENT_MESSAGES_REJECTED, topic=self._inbound_topic, count=plan.rejected,
                      first_reason=plan.first_rejection)
        return plan.split

    def close(self) -> None:
        """Release the clients; whatever was not committed is split again by the next splitter."""
        try:
            self._consumer.close()
        finally:
            self._producer.flush(1.0)
            self._redis.close()

    def _prepare_topics(self, plan: SplitPlan, stop: threading.Event) -> None:
        """Create the batch's new source topics, many per request; reject the messages of a
        topic Kafka refuses.

        A refused name (``urls.a_b`` collides with ``urls.a.b`` on Kafka) is bad
        input: retrying it forever would stall every other source behind it. Any
        other error (the broker away) retries the batch; the topics created so far
        stay known, so a retry asks only for the rest.
        """
        new = sorted({topic for topic, _, _ in plan.records} - self._ready_topics - set(self._refused))
        for start in range(0, len(new), TOPIC_CREATE_BATCH):
            if stop.is_set():
                raise Stopping()
            chunk = new[start:start + TOPIC_CREATE_BATCH]
            errors = self._create_topics(chunk)
            transient = None
            for topic in chunk:
                error = errors.get(topic)
                if error is None:
                    self._ready_topics.add(topic)
                elif error.code() in _REFUSED_TOPIC_ERRORS:
                    self._refused[topic] = f"Kafka refuses topic {topic}: {error.str()}"
                else:
                    transient = transient or error
            # Workers subscribe to the sources they see in inbound_sources: told now, they
            # join the topics while the rest are created (issue 20: 5,000 new topics take
            # seconds, and the first request waited for all of them).
            created = [contracts.source_of_topic(topic) for topic in chunk if topic in self._ready_topics]
            if created:
                self._redis.sadd(contracts.INBOUND_SOURCES, *created)
            if transient is not None:
                raise KafkaException(transient)  # the broker is away: retry the batch
        if any(topic in self._refused for topic, _, _ in plan.records):
            records, plan.records = plan.records, []
            for topic, key, value in records:
                reason = self._refused.get(topic)
                if reason:
                    topic, key = contracts.REJECTED_TOPIC, None
                    value = contracts.rejected_message(self._inbound_topic, value, reason)
                    plan.split, plan.rejected = plan.split - 1, plan.rejected + 1
                    plan.first_rejection = plan.first_rejection or reason
                plan.records.append((topic, key, value))
            plan.sources = {contracts.source_of_topic(topic) for topic, _, _ in plan.records
                            if topic != contracts.REJECTED_TOPIC}

    def _deliver(self, plan: SplitPlan, stop: threading.Event) -> None:
        self._prepare_topics(plan, stop)
        pending = plan.records
        while pending:
            failed: list[Record] = []
            rejections: list[Record] = []  # of messages Kafka refuses: resending them would fail forever

            def on_failure(err: KafkaError | None, message: Message, failed: list[Record] = failed,
                           rejections: list[Record] = rejections) -> None:
                if err is not None:  # the producer reports failures only
                    # A message that never reached the broker (timed out in the queue) has a
                    # topic but no partition or offset: only the topic is read.
                    topic = message.topic()
                    if topic is None:
                        raise ValueError(f"a failed delivery without a topic: {err}")
                    record = (topic, message.key(), message.value() or b"")
                    if refuses_the_message(err):
                        rejections.extend(self._rejection(record, err, plan))
                    else:
                        failed.append(record)

            for topic, key, value in pending:
                try:
                    self._produce(topic, key, value, on_failure)
                except KafkaException as exc:  # refused before sending (larger than message.max.bytes)
                    if not refuses_the_message(exc.args[0]):
                        raise
                    rejections.extend(self._rejection((topic, key, value), exc.args[0], plan))
            while self._producer.flush(SPLIT_FLUSH_SECONDS) > 0:
                if stop.is_set():
                    raise Stopping()
            if failed:
                # Resend only what failed: whatever was acknowledged stays acknowledged.
                _report(f"{len(failed)} of {len(pending)} messages not acknowledged; resending them")
                if stop.wait(1.0):
                    raise Stopping()
            pending = failed + rejections

    def _rejection(self, record: Record, err: KafkaError, plan: SplitPlan) -> list[Record]:
        """The rejected_messages record for a message Kafka refused (too large, invalid); none if
        it was a rejection already (logged: there is nowhere else to put it)."""
        topic, _key, value = record
        reason = f"Kafka refused it on {topic}: {err.name()} ({err.str()})"
        if topic == contracts.REJECTED_TOPIC:
            _report(f"{reason}; the rejection is lost", raw=value[:200].decode("utf-8", errors="replace"))
            return []
        plan.split, plan.rejected = plan.split - 1, plan.rejected + 1
        plan.first_rejection = plan.first_rejection or reason
        return [(contracts.REJECTED_TOPIC, None, contracts.rejected_message(self._inbound_topic, value, reason))]

    def _record(self, plan: SplitPlan) -> None:
        if plan.split:
            with self._redis.pipeline(transaction=False) as pipe:
                pipe.sadd(contracts.INBOUND_SOURCES, *plan.sources)
                pipe.incrby(contracts.NUM_SPLIT, plan.split)
                pipe.execute()

    def _produce(self, topic: str, key: Any, value: bytes, on_delivery: Callable) -> None:
        produce_waiting(self._producer, topic, value, key, on_delivery)

    def _retry_until_done(self, step: Callable[[], None], stop: threading.Event) -> None:
        """Retry a batch that hit a broken broker or Redis, with backoff, until it is done or we stop.

        The batch must not be skipped: committing the next one would commit past it.
        """
        delay = 0.5
        while True:
            try:
                step()
                return
            except Stopping:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: same batch again, never skip it
                _report(f"{type(exc).__name__}: {exc}", retry_in=delay)
            if stop.wait(delay):
                raise Stopping()
            delay = min(delay * 2, SPLIT_MAX_BACKOFF_SECONDS)

    def _commit(self, offsets: list[TopicPartition]) -> None:
        if not offsets:
            return
        try:
            self._consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            # The broker is away: the next batch's commit covers these offsets too, and if
            # none comes, the next splitter re-splits from the last commit. Duplicates, never losses.
            _report(f"commit failed: {exc}")


def connect(settings: Settings, *, inbound_topic: str = contracts.INBOUND_TOPIC,
            group: str = contracts.SPLITTER_GROUP, batch_size: int = SPLIT_BATCH_SIZE) -> Splitter:
    """A splitter on the real servers (blocking: call it from the splitter's thread).

    It takes every partition of the inbound topic with ``assign()`` rather than
    joining a consumer group: a join costs seconds at every start (half the
    session timeout on tansu), and the monitor lease already makes this the
    only splitter. The group id still keeps the committed offsets.
    """
    hosts, partitions = settings.kafka_hosts, settings.kafka_partitions
    # One admin client for the splitter's life: a client per topic was issue 20's bottleneck.
    topics = TopicCreator(hosts, partitions)
    topics.ensure([inbound_topic, contracts.REJECTED_TOPIC])
    consumer = Consumer(consumer_config(hosts, group))
    producer = Producer(producer_config(hosts, **{"delivery.report.only.error": True}))
    redis = Redis.from_url(settings.redis_url, decode_responses=True)
    splitter = Splitter(consumer, producer, redis, topics.create,
                        inbound_topic=inbound_topic, batch_size=batch_size)
    splitter.assign_new_partitions()
    return splitter


async def run_splitter(make_splitter: Callable[[], Splitter], stop_seconds: float) -> None:
    """Run the splitter on its own thread until cancelled; reconnect after a failure.

    On cancellation the current batch is finished (or abandoned uncommitted)
    within ``stop_seconds``; past that the thread is left to die with the
    process, which is safe for the same reason: nothing uncommitted is lost.
    """
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    finished: asyncio.Future[None] = loop.create_future()

    def work() -> None:
        delay = 1.0
        while not stop.is_set():
            try:
                splitter = make_splitter()
                try:
                    splitter.run(stop)
                finally:
                    splitter.close()
            except Stopping:
                break
            except Exception as exc:  # noqa: BLE001 - reconnect rather than stop splitting
                _report(f"{type(exc).__name__}: {exc}", retry_in=delay)
                stop.wait(delay)
                delay = min(delay * 2, SPLIT_MAX_BACKOFF_SECONDS)
        try:
            loop.call_soon_threadsafe(_settle, finished)
        except RuntimeError:  # the loop is gone already
            pass

    threading.Thread(target=work, name="splitter", daemon=True).start()
    try:
        await asyncio.shield(finished)
    finally:
        stop.set()
        if not finished.done():
            try:
                await asyncio.wait_for(asyncio.shield(finished), stop_seconds)
            except TimeoutError:
                _report("did not stop in time; its uncommitted batch will be re-split")


def _settle(finished: asyncio.Future[None]) -> None:
    if not finished.done():
        finished.set_result(None)
