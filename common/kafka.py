"""confluent-kafka, kept off the event loop.

librdkafka's poll/consume/commit/flush block, so every call on a client goes
through that client's own single thread (the clients are not safe for
concurrent calls). A produce is awaited until the broker acknowledges it:
offsets are committed only after the outcome is durable (at-least-once),
and a full local queue is waited out instead of dropping the message.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from collections.abc import Callable, Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from common.contracts import EVENT_KAFKA_CLIENT_ERROR
from common.jsonlog import log_event
from common.offset_gaps import OffsetGaps, consume_whole
from common.settings import Settings

T = TypeVar("T")

SESSION_TIMEOUT_MS = Settings.kafka_session_timeout_ms  # a consumer group's session, when no setting is given
CLIENT_LOG_INTERVAL = 10.0  # seconds between two kafka_client_error events of one kind
TOPIC_CREATE_TIMEOUT = 15.0  # seconds for one CreateTopics request


class ClientLog(logging.Handler):
    """librdkafka's own log lines and errors as ``kafka_client_error`` JSON events.

    Without it librdkafka writes plain text to stderr, every 50 ms while a broker is
    unreachable: an operator tailing the JSON log gets a flood. Here each kind (the
    librdkafka facility, or the error's name) is logged at most once per interval, with
    the count of lines it stood for. Lines below WARNING (librdkafka's notices) are dropped.
    """

    def __init__(self, interval: float = CLIENT_LOG_INTERVAL, clock: Callable[[], float] = time.monotonic):
        super().__init__(logging.WARNING)
        self._interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._guard = threading.Lock()  # librdkafka calls back from each client's own thread
        self.logger = logging.Logger("librdkafka")
        self.logger.addHandler(self)

    def error_cb(self, error: KafkaError) -> None:
        self.report(error.name(), error.str())

    def emit(self, record: logging.LogRecord) -> None:
        # confluent-kafka calls logger.log(level, "%s [%s] %s", facility, client name, message)
        facility, client, message = (record.args + ("", "", ""))[:3] if isinstance(record.args, tuple) \
            else ("log", "", record.getMessage())
        self.report(str(facility), str(message), client=str(client))

    def report(self, kind: str, reason: str, **fields: str) -> None:
        now = self._clock()
        with self._guard:
            if now - self._last.get(kind, -self._interval) < self._interval:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._last[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        log_event(EVENT_KAFKA_CLIENT_ERROR, kind=kind, reason=reason[:500], suppressed=suppressed, **fields)


CLIENT_LOG = ClientLog()  # one per process: the interval holds across all its clients


def client_config(hosts: str) -> dict[str, Any]:
    """What every client gets: the brokers, and its log and errors through ours."""
    return {"bootstrap.servers": hosts, "logger": CLIENT_LOG.logger, "error_cb": CLIENT_LOG.error_cb}


def producer_config(hosts: str, **extra: Any) -> dict[str, Any]:
    return {
        **client_config(hosts),
        "acks": "all",
        "linger.ms": 50,  # a produce request carries 50 ms of messages: the broker's CPU a URL (docs/decisions.md)
        "message.timeout.ms": 120_000,
        "queue.buffering.max.messages": 200_000,
        **extra,
    }


def consumer_config(hosts: str, group: str, session_timeout_ms: int = SESSION_TIMEOUT_MS,
                    **extra: Any) -> dict[str, Any]:
    return {
        **client_config(hosts),
        "group.id": group,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "session.timeout.ms": session_timeout_ms,
        "heartbeat.interval.ms": min(1000, session_timeout_ms // 3),
        "topic.metadata.refresh.interval.ms": 5000,
        **extra,
    }


def coordinates(message: Message) -> tuple[str, int, int]:
    """(topic, partition, offset) of a consumed message; only an error event lacks them."""
    topic, partition, offset = message.topic(), message.partition(), message.offset()
    if topic is None or partition is None or offset is None:
        raise ValueError(f"a message without a topic, partition or offset: {message.error()}")
    return topic, partition, offset


def produce_waiting(producer: Producer, topic: str, value: bytes | None, key: Any = None,
                    on_delivery: Callable | None = None, partition: int | None = None) -> None:
    """Enqueue, waiting out a full local queue (BufferError) instead of dropping the message:
    for code on a thread of its own (the splitter, the TSV producer, the benchmarks' loaders).
    ``partition`` None: the producer's partitioner chooses by key."""
    while True:
        try:
            if partition is None:
                producer.produce(topic, value=value, key=key, on_delivery=on_delivery)
            else:
                producer.produce(topic, value=value, key=key, on_delivery=on_delivery, partition=partition)
            return
        except BufferError:
            producer.poll(0.1)  # serves delivery reports, which frees room


class DeliveryFailed(Exception):
    """The broker did not acknowledge a message."""


class MessageRefused(DeliveryFailed):
    """The broker (or the client, before sending) refused this one message: sending it again
    gets the same answer, and other messages are unaffected. Not an outage."""

    def __init__(self, error: KafkaError):
        super().__init__(f"{error.name()}: {error.str()}")
        self.error = error


# Errors about one message's content, not the cluster: too large for the client or the topic,
# a record (or batch) the broker finds invalid, a bad timestamp, a value the client cannot take.
REFUSED_MESSAGE_ERRORS = frozenset({
    KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_MSG_SIZE, KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.INVALID_RECORD, KafkaError.INVALID_MSG, KafkaError.INVALID_TIMESTAMP,
    KafkaError._INVALID_ARG, KafkaError._BAD_MSG,
})


def refuses_the_message(error: object) -> bool:
    """Whether ``error`` is about the one message (so resending it is pointless)."""
    return isinstance(error, KafkaError) and error.code() in REFUSED_MESSAGE_ERRORS


def delivery_error(error: KafkaError) -> DeliveryFailed:
    return MessageRefused(error) if refuses_the_message(error) else DeliveryFailed(str(error))


class AsyncProducer:
    """A Producer whose ``send`` resolves when the broker acknowledges the message.

    Delivery reports come on the polling thread; those served by one ``poll`` reach the event
    loop in one wake-up (a wake-up each cost ~7% of a worker's event loop)."""

    def __init__(self, config: dict[str, Any]):
        self._producer = Producer(config)
        self._reports: list[tuple[asyncio.Future[None], KafkaError | None]] = []
        self._reports_lock = threading.Lock()
        self._stopping = threading.Event()
        self._poller = threading.Thread(target=self._poll_forever, name="kafka-producer-poll", daemon=True)
        self._poller.start()

    def _poll_forever(self) -> None:
        while not self._stopping.is_set():
            self._producer.poll(0.1)
            self._hand_over()

    def _hand_over(self) -> None:
        """Resolve the reports served so far on their event loop, in one call."""
        with self._reports_lock:
            reports, self._reports = self._reports, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[None], KafkaError | None]]] = {}
        for report in reports:
            by_loop.setdefault(report[0].get_loop(), []).append(report)
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits them
                loop.call_soon_threadsafe(_resolve_all, batch)

    async def send(self, topic: str, value: bytes, key: bytes | str | None = None,
                   partition: int | None = None) -> None:
        """``partition`` None: the partitioner places the message by its key."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def on_delivery(err: KafkaError | None, _msg: Message) -> None:
            with self._reports_lock:
                self._reports.append((future, err))

        await self._produce(topic, value, key, on_delivery, partition)
        await future

    async def _produce(self, topic: str, value: bytes, key: Any, on_delivery: Callable,
                       partition: int | None = None) -> None:
        # produce() only enqueues; a full queue raises BufferError, which we wait out. A message
        # the client refuses outright (larger than message.max.bytes) raises KafkaException.
        while True:
            try:
                if partition is None:
                    self._producer.produce(topic, value=value, key=key, on_delivery=on_delivery)
                else:
                    self._producer.produce(topic, value=value, key=key, on_delivery=on_delivery, partition=partition)
                return
            except BufferError:
                await asyncio.sleep(0.05)
            except KafkaException as exc:
                error = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
                if error is not None and refuses_the_message(error):
                    raise MessageRefused(error) from None
                raise

    async def flush(self, timeout: float = 30.0) -> int:
        """Wait for every queued message; returns how many are still undelivered."""
        remaining = await asyncio.to_thread(self._producer.flush, timeout)
        self._hand_over()  # what flush() served on its own thread
        return remaining

    async def close(self, timeout: float = 30.0) -> int:
        remaining = await self.flush(timeout)
        self._stopping.set()
        await asyncio.to_thread(self._poller.join)
        return remaining


def _resolve_all(reports: list[tuple[asyncio.Future[None], KafkaError | None]]) -> None:
    for future, err in reports:
        _resolve(future, err)


def _resolve(future: asyncio.Future[None], err: KafkaError | None) -> None:
    if future.done():
        return
    if err is None:
        future.set_result(None)
    else:
        future.set_exception(delivery_error(err))


class AsyncConsumer:
    """A Consumer whose every call runs on one dedicated thread; its messages come without
    gaps the broker did not mean (``common.offset_gaps``)."""

    def __init__(self, config: dict[str, Any]):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kafka-consumer")
        self._consumer: Consumer = self._executor.submit(Consumer, config).result()
        self._gaps = OffsetGaps()

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(consumer, *args)`` on the consumer's thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(self._consumer, *args, **kwargs))

    async def subscribe(self, topics: list[str], **callbacks: Callable[[Consumer, list[TopicPartition]], None]) -> None:
        """``on_assign``, ``on_revoke``, ``on_lost`` as librdkafka's; the partitions they name
        start again without an expected offset (an assignment places them anew)."""
        def forgetting(callback: Callable[[Consumer, list[TopicPartition]], None]) -> Callable[..., None]:
            def call(consumer: Consumer, parts: list[TopicPartition]) -> None:
                self._gaps.forget((part.topic, part.partition) for part in parts)
                callback(consumer, parts)
            return call
        wrapped = {name: forgetting(callback) for name, callback in callbacks.items()}
        await self.call(lambda c: c.subscribe(topics, **wrapped))

    async def consume(self, num_messages: int, timeout: float) -> list[Message]:
        return await self.call(lambda c: consume_whole(c, self._gaps, num_messages, timeout))

    async def seek(self, positions: dict[tuple[str, int], int]) -> None:
        """Read each partition again from its offset (it must be assigned to this consumer)."""
        def seek_all(consumer: Consumer) -> None:
            for (topic, partition), offset in positions.items():
                consumer.seek(TopicPartition(topic, partition, offset))
                self._gaps.moved((topic, partition), offset)
        await self.call(seek_all)

    async def commit_offsets(self, offsets: list) -> None:
        """Synchronously commit explicit offsets (``TopicPartition`` with next offset)."""
        if offsets:
            await self.call(lambda c: c.commit(offsets=offsets, asynchronous=False))

    async def close(self, leave_group: bool = True) -> None:
        """Leave the group (its partitions move to the others at once), or, with
        ``leave_group=False``, destroy the client without a LeaveGroup so the broker
        evicts the member after ``session.timeout.ms``. tansu 0.6 needs the latter: a
        LeaveGroup from the leader while the group re-forms leaves it waiting for a
        leader that is gone, and every later member hangs (README, "Restarts")."""
        try:
            if leave_group:
                await self.call(lambda c: c.close())
            else:
                await self.call(self._destroy_without_leaving)
        finally:
            self._executor.shutdown(wait=True)

    def _destroy_without_leaving(self, consumer: Consumer) -> None:
        # confluent-kafka's dealloc destroys the handle with RD_KAFKA_DESTROY_F_NO_CONSUMER_CLOSE:
        # no LeaveGroup, no commit (the scheduler has committed what finished).
        del self._consumer, consumer


class TopicCreator:
    """One AdminClient for the life of its owner, creating topics many per request.

    Each AdminClient is a librdkafka handle of its own (``rdkafka#producer-N``) with
    its own connections and bootstrap: one per topic would be the splitter's bottleneck.
    """

    def __init__(self, hosts: str, partitions: int, timeout: float = TOPIC_CREATE_TIMEOUT):
        self._admin = AdminClient(client_config(hosts))
        self._partitions = partitions
        self._timeout = timeout

    def create(self, topics: list[str]) -> dict[str, KafkaError]:
        """Create ``topics`` in one request; return the error of each topic neither created
        nor already there (a refused name, or the broker away), by topic."""
        if not topics:
            return {}
        futures = self._admin.create_topics(
            [NewTopic(name, num_partitions=self._partitions, replication_factor=1) for name in topics],
            operation_timeout=self._timeout, request_timeout=self._timeout,
        )
        errors: dict[str, KafkaError] = {}
        for name, future in futures.items():
            try:
                future.result(timeout=self._timeout)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    errors[name] = exc.args[0]
        return errors

    def ensure(self, topics: list[str]) -> None:
        """Create ``topics`` or find them there; raise the first error otherwise."""
        errors = self.create(topics)
        if errors:
            raise KafkaException(next(iter(errors.values())))


def ensure_topics(hosts: str, topics: Iterable[str], partitions: int, timeout: float = TOPIC_CREATE_TIMEOUT) -> None:
    """Create topics with ``partitions`` partitions; existing ones are left as they are."""
    TopicCreator(hosts, partitions, timeout).ensure(list(topics))


def list_topics(hosts: str, timeout: float = 10.0) -> dict[str, int]:
    """Topic name -> partition count."""
    metadata = AdminClient(client_config(hosts)).list_topics(timeout=timeout)
    return {name: len(topic.partitions) for name, topic in metadata.topics.items()}
