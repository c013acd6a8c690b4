"""The worker joins its consumer group before the rest of it loads (worker.intake.group_join): the join
takes seconds whatever the worker does meanwhile. If it cannot (Kafka away), the worker makes
the topics and subscribes the patient way instead, so the head start can cost nothing."""
from __future__ import annotations

import time

from common.contracts import URLS_TOPIC
from common.kafka import list_topics
from common.settings import Settings
from devstack.servers import free_port
from worker.intake import group_join
from worker.intake.group_join import joined, start_joining


async def test_a_worker_joins_its_group_while_it_loads_and_the_scheduler_subscribes_no_more(
        kafka_hosts: str, unique: str, monkeypatch) -> None:
    monkeypatch.setattr(group_join, "WORKER_GROUP", f"joining-{unique}")
    settings = Settings.from_env({"KAFKA_HOSTS": kafka_hosts, "URL_PARTITIONS": "4"})
    early = await joined(start_joining(settings))
    assert early is not None
    consumer, feed = early
    try:
        again: list[list[str]] = []
        subscribe = consumer.subscribe

        async def counted(topics: list[str], **callbacks) -> None:
            again.append(topics)
            await subscribe(topics, **callbacks)
        monkeypatch.setattr(consumer, "subscribe", counted)
        await feed.subscribe([URLS_TOPIC])  # what Scheduler.run does: a second subscription would rejoin
        assert again == []
        assigned, revoked = [], []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not assigned:  # the join went on while nothing polled
            batch = await feed.poll(100, 0.2)
            assigned += batch.assigned
            revoked += batch.revoked
        partitions = list_topics(kafka_hosts)[URLS_TOPIC]  # made here, or by a test before with its own count
        assert sorted(assigned) == [(URLS_TOPIC, p) for p in range(partitions)] and not revoked
    finally:
        await consumer.close()


async def test_with_kafka_away_the_head_start_gives_way_to_the_patient_path() -> None:
    settings = Settings.from_env({"KAFKA_HOSTS": f"127.0.0.1:{free_port()}"})
    assert await joined(start_joining(settings)) is None
