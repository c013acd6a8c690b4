"""The splitter: ``inbound_images`` routed into the one ``urls`` topic (SPEC.md §1).

Each URL goes to a partition of its source (``contracts.url_partition``): a slow
source keeps to one partition, a fast one spreads over as many as its limit needs,
so several workers share it. No topic is created per source and the workers'
subscription never changes, so a new source costs the group no rebalance.
Throughput comes from batches: one consume of thousands of messages, one flush,
one commit, one Redis call. The inbound offsets are committed only once
every message of the batch is acknowledged by the broker, so a crash anywhere
before the commit re-splits the batch (at-least-once) instead of losing it. The
whole loop runs on its own thread: every Kafka call blocks, and none of them may
stall the monitor's event loop.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from redis import Redis

from common import contracts
from common.jsonlog import log_event
from common.kafka import (TopicCreator, consumer_config, coordinates, produce_waiting, producer_config,
                          refuses_the_message)
from common.offset_gaps import OffsetGaps, consume_whole
from common.settings import Settings
from common.protocols import SyncRedis
from crawl_monitor.constants import (SPLIT_BATCH_SIZE, SPLIT_FLUSH_SECONDS,
                                     SPLIT_MAX_BACKOFF_SECONDS, SPLIT_PARTITION_CHECK_SECONDS, SPLIT_POLL_SECONDS)

Record = tuple[str, Any, bytes, int | None]  # topic, key, value, partition (None: by key)
LimitOf = Callable[[str], float | None]      # a source's limit in req/s, None when not known yet


def _report(error: str, **fields: Any) -> None:
    log_event(contracts.EVENT_MONITOR_COMPONENT_ERROR, component="splitter", error=error, **fields)


class Stopping(Exception):
    """Asked to stop before the batch was done: it stays uncommitted and is re-split later."""


@dataclass
class SplitPlan:
    """Where each message of one consumed batch goes, and the offsets that batch commits."""

    records: list[Record] = field(default_factory=list)
    new_urls: Counter[str] = field(default_factory=Counter)  # source -> URLs split for the first time
    split: int = 0
    rejected: int = 0
    first_rejection: str = ""
    offsets: list[TopicPartition] = field(default_factory=list)


def plan_batch(messages: Iterable[Message], inbound_topic: str, partitions: int,
               limit_of: LimitOf = lambda source: None) -> SplitPlan:
    """Validate each message and route it: its partition of ``urls``, or ``rejected_messages``
    with the reason."""
    plan = SplitPlan()
    next_offsets: dict[tuple[str, int], int] = {}
    shards: dict[str, int] = {}
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
            source = request.source
            if source not in shards:
                shards[source] = contracts.url_shards(limit_of(source))
            place = contracts.url_partition(source, request.uuid, shards[source], partitions)
            plan.records.append((contracts.URLS_TOPIC, source.encode(), request.to_json(), place))
            plan.new_urls[source] += request.attempts == 0  # a retry is not a new URL of the backlog
            plan.split += 1
            continue
        plan.records.append((contracts.REJECTED_TOPIC, None,
                             contracts.rejected_message(inbound_topic, raw, reason), None))
        plan.rejected += 1
        plan.first_rejection = plan.first_rejection or reason
    plan.offsets = [TopicPartition(topic, partition, offset)
                    for (topic, partition), offset in next_offsets.items()]
    return plan


# KEYS: inbound_sources, num_split, waiting_sources, then urls_split:{source} of each source with URLs
# split for the first time; ARGV: the URLs split, now, the batch's sources, then each key's count.
# One command a batch: through redis-py's pipeline each INCRBY, and each member of the SADD and the
# ZADD, was packed apart (a one-URL site is a source a URL; docs/decisions.md, "Fleet scale").
RECORD_SPLIT = """
local counted = #KEYS - 3
local last = #ARGV - counted
redis.call('INCRBY', KEYS[2], ARGV[1])
for first = 3, last, 1000 do
  local upto = math.min(first + 999, last)
  redis.call('SADD', KEYS[1], unpack(ARGV, first, upto))
  local scored = {}
  for i = first, upto do
    scored[#scored + 1] = ARGV[2]
    scored[#scored + 1] = ARGV[i]
  end
  redis.call('ZADD', KEYS[3], 'GT', unpack(scored))
end
for i = 1, counted do redis.call('INCRBY', KEYS[3 + i], ARGV[last + i]) end
return counted
"""


class Splitter:
    """One consumer, one producer and a Redis client, driven batch by batch from one thread."""

    def __init__(self, consumer: Consumer, producer: Producer, redis: SyncRedis, *,
                 limit_of: LimitOf = lambda source: None,
                 inbound_topic: str = contracts.INBOUND_TOPIC, batch_size: int = SPLIT_BATCH_SIZE,
                 poll_seconds: float = SPLIT_POLL_SECONDS, url_partitions: int = 1,
                 clock: Callable[[], float] = time.time):
        """``clock``: Unix time as the regulator reads ``waiting_sources`` (``RedisClock.now``)."""
        self._consumer = consumer
        self._clock = clock
        self._gaps = OffsetGaps()
        self._producer = producer
        self._redis = redis
        self._record_split = redis.register_script(RECORD_SPLIT)
        self._limit_of = limit_of
        self._inbound_topic = inbound_topic
        self._batch_size = batch_size
        self._poll_seconds = poll_seconds
        self._assigned: set[int] = set()     # inbound partitions being read
        self.url_partitions = url_partitions  # of the urls topic as the broker has it

    def run(self, stop: threading.Event) -> None:
        checked = time.monotonic()
        while not stop.is_set():
            self.split_once(stop)
            if time.monotonic() - checked > SPLIT_PARTITION_CHECK_SECONDS:
                self.assign_new_partitions()
                self.count_url_partitions()
                checked = time.monotonic()

    def _partitions_of(self, topic: str) -> list[int]:
        metadata = self._consumer.list_topics(topic, timeout=SPLIT_FLUSH_SECONDS)
        found = metadata.topics[topic]
        if found.error is not None:
            raise KafkaException(found.error)
        return sorted(found.partitions)

    def assign_new_partitions(self) -> None:
        """Read every partition of the inbound topic, including any an operator added since."""
        new = sorted(set(self._partitions_of(self._inbound_topic)) - self._assigned)
        if new:
            # No offset given: each starts from the group's committed offset (else the earliest).
            self._consumer.incremental_assign([TopicPartition(self._inbound_topic, p) for p in new])
            self._assigned.update(new)

    def count_url_partitions(self) -> None:
        """Route over the partitions ``urls`` has now: an operator may add some (README)."""
        self.url_partitions = len(self._partitions_of(contracts.URLS_TOPIC)) or self.url_partitions

    def split_once(self, stop: threading.Event) -> int:
        """Split one batch; return how many messages went to ``urls``."""
        messages = consume_whole(self._consumer, self._gaps, self._batch_size, self._poll_seconds)
        if not messages:
            return 0
        plan = plan_batch(messages, self._inbound_topic, self.url_partitions, self._limit_of)
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

    def _deliver(self, plan: SplitPlan, stop: threading.Event) -> None:
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
                    record = (topic, message.key(), message.value() or b"", message.partition())
                    if refuses_the_message(err):
                        rejections.extend(self._rejection(record, err, plan))
                    else:
                        failed.append(record)

            for topic, key, value, partition in pending:
                try:
                    produce_waiting(self._producer, topic, value, key, on_failure, partition)
                except KafkaException as exc:  # refused before sending (larger than message.max.bytes)
                    if not refuses_the_message(exc.args[0]):
                        raise
                    rejections.extend(self._rejection((topic, key, value, partition), exc.args[0], plan))
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
        topic, key, value, _partition = record
        reason = f"Kafka refused it on {topic}: {err.name()} ({err.str()})"
        if topic == contracts.REJECTED_TOPIC:
            _report(f"{reason}; the rejection is lost", raw=value[:200].decode("utf-8", errors="replace"))
            return []
        plan.split, plan.rejected = plan.split - 1, plan.rejected + 1
        if isinstance(key, bytes) and json.loads(value).get("attempts", 0) == 0:  # our own message, keyed by source
            plan.new_urls[key.decode()] -= 1  # no URL of the backlog after all
        plan.first_rejection = plan.first_rejection or reason
        return [(contracts.REJECTED_TOPIC, None, contracts.rejected_message(self._inbound_topic, value, reason), None)]

    def _record(self, plan: SplitPlan) -> None:
        if plan.split:
            # A split source is scored in waiting_sources, so it is ticked and its rate published: a
            # worker past its bound looks it up to take only fast sources' URLs (docs/decisions.md,
            # "Fleet scale").
            counted = [source for source, count in plan.new_urls.items() if count]
            self._record_split(
                keys=[contracts.INBOUND_SOURCES, contracts.NUM_SPLIT, contracts.WAITING_SOURCES,
                      *(contracts.urls_split_key(source) for source in counted)],
                args=[plan.split, self._clock(), *plan.new_urls, *(plan.new_urls[source] for source in counted)])

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


def connect(settings: Settings, *, limit_of: LimitOf = lambda source: None,
            clock: Callable[[], float] = time.time, inbound_topic: str = contracts.INBOUND_TOPIC,
            group: str = contracts.SPLITTER_GROUP, batch_size: int = SPLIT_BATCH_SIZE) -> Splitter:
    """A splitter on the real servers (blocking: call it from the splitter's thread).

    It takes every partition of the inbound topic with ``assign()`` rather than
    joining a consumer group: a join costs seconds at every start (half the
    session timeout on tansu), and the monitor lease already makes this the
    only splitter. The group id still keeps the committed offsets.
    """
    hosts = settings.kafka_hosts
    TopicCreator(hosts, contracts.INBOUND_PARTITIONS).ensure([inbound_topic, contracts.REJECTED_TOPIC])
    TopicCreator(hosts, settings.url_partitions).ensure([contracts.URLS_TOPIC])
    consumer = Consumer(consumer_config(hosts, group))
    producer = Producer(producer_config(hosts, **{"delivery.report.only.error": True}))
    redis = Redis.from_url(settings.redis_url, decode_responses=True)
    splitter = Splitter(consumer, producer, redis, limit_of=limit_of, inbound_topic=inbound_topic,
                        batch_size=batch_size, url_partitions=settings.url_partitions, clock=clock)
    splitter.assign_new_partitions()
    splitter.count_url_partitions()
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
