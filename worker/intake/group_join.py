"""Joining the workers' consumer group before the rest of the worker loads.

A group join takes seconds whatever the worker does meanwhile: tansu answers a
JoinGroup after half of ``session.timeout.ms`` (1 s on the local stack), Apache Kafka after
``group.initial.rebalance.delay.ms`` for a new group. Importing the image, HTTP
and S3 libraries and starting the image pool took another ~1.5 s before the
worker subscribed; begun first, on a thread of its own, the join runs while they
load. It is only a head start: if it fails (Kafka not up yet, say), the worker
creates the topics and subscribes the patient way (``worker.service``).
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor

from common.contracts import HALTED_URLS_TOPIC, URLS_TOPIC, WAIT_TOPIC_PARTITIONS, WAIT_TOPICS, WORKER_GROUP
from common.kafka import AsyncConsumer, consumer_config, ensure_topics
from common.settings import Settings
from worker.constants import CONSUMER_EXTRA_CONFIG
from worker.intake.feed import KafkaFeed

Joining = Future[tuple[AsyncConsumer, KafkaFeed]]


def ensure_worker_topics(settings: Settings) -> None:
    """Every topic this worker reads, so that a worker started before the monitor subscribes to
    topics that exist (librdkafka would look for a missing one again only minutes later)."""
    ensure_topics(settings.kafka_hosts, [URLS_TOPIC], settings.url_partitions)
    ensure_topics(settings.kafka_hosts, [*WAIT_TOPICS, HALTED_URLS_TOPIC], WAIT_TOPIC_PARTITIONS)


def worker_consumer(settings: Settings, group: str) -> AsyncConsumer:
    """A consumer of one of the workers' groups: their prefetch, and the stack's session length."""
    return AsyncConsumer(consumer_config(settings.kafka_hosts, group, settings.kafka_session_timeout_ms,
                                         **CONSUMER_EXTRA_CONFIG))


def start_joining(settings: Settings) -> Joining:
    """The topics made and the urls consumer subscribed, on a thread: its result, or its error."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="joining")
    joining = executor.submit(_join, settings)
    executor.shutdown(wait=False)  # its thread ends with the join
    return joining


def _join(settings: Settings) -> tuple[AsyncConsumer, KafkaFeed]:
    ensure_worker_topics(settings)
    consumer = worker_consumer(settings, WORKER_GROUP)
    feed = KafkaFeed(consumer, WORKER_GROUP, settings.url_partition_share)
    asyncio.run(feed.subscribe([URLS_TOPIC]))  # the consumer's calls run on its own thread, whatever the loop
    return consumer, feed


async def joined(joining: Joining) -> tuple[AsyncConsumer, KafkaFeed] | None:
    """The consumer subscribed early, or None if that failed (the worker then does it itself)."""
    try:
        return await asyncio.wrap_future(joining)
    except Exception:  # noqa: BLE001 - Kafka away or any client error: the patient way, retried, follows
        return None
