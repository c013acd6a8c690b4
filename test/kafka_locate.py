"""Where URLs without an outcome are: a failing crawl test's report, read from the broker.

For each identifier, the last record that carries it in ``inbound_images`` (a retry), ``urls``,
the wait topics or ``urls_halted``, and whether its group has committed past it (then the URL was
handed on or lost) or not (it still waits there). Reads with a group-less consumer,
so it changes no commit.
"""
from __future__ import annotations

import json
from collections import Counter

from confluent_kafka import Consumer, TopicPartition

from common.contracts import (HALTED_GROUP, HALTED_URLS_TOPIC, INBOUND_TOPIC, SPLITTER_GROUP, URLS_TOPIC, WAIT_GROUP,
                              WAIT_TOPICS, WORKER_GROUP)

GROUPS = {INBOUND_TOPIC: SPLITTER_GROUP, URLS_TOPIC: WORKER_GROUP, HALTED_URLS_TOPIC: HALTED_GROUP,
          **{t: WAIT_GROUP for t in WAIT_TOPICS}}


def _committed(hosts: str, group: str, parts: list[TopicPartition]) -> dict[tuple[str, int], int]:
    consumer = Consumer({"bootstrap.servers": hosts, "group.id": group, "enable.auto.commit": False})
    try:
        return {(p.topic, p.partition): p.offset for p in consumer.committed(parts, timeout=10)}
    finally:
        consumer.close()


def locate(hosts: str, identifiers: set[str]) -> str:
    """One line per place the identifiers' last records are, counted."""
    reader = Consumer({"bootstrap.servers": hosts, "group.id": "locate", "enable.auto.commit": False,
                       "enable.partition.eof": True})
    last: dict[str, tuple[str, int, int]] = {}
    try:
        metadata = reader.list_topics(timeout=10)
        parts = [TopicPartition(t, p, 0) for t in GROUPS if t in metadata.topics
                 for p in metadata.topics[t].partitions]
        ends = {(p.topic, p.partition): reader.get_watermark_offsets(p, timeout=10)[1] for p in parts}
        reader.assign([p for p in parts if ends[(p.topic, p.partition)] > 0])
        left = {tp for tp, end in ends.items() if end > 0}
        while left:
            message = reader.poll(5)
            if message is None:
                break
            tp = (message.topic(), message.partition())
            if message.error():
                left.discard(tp)
                continue
            try:
                uuid = json.loads(message.value()).get("uuid")
            except (ValueError, AttributeError):
                continue
            if uuid in identifiers:
                last[uuid] = (*tp, message.offset())
    finally:
        reader.close()
    committed: dict[tuple[str, int], int] = {}
    for topic, group in GROUPS.items():
        committed.update(_committed(hosts, group, [p for p in parts if p.topic == topic]))
    places: Counter[str] = Counter()
    for uuid in identifiers:
        if uuid not in last:
            places["nowhere"] += 1
            continue
        topic, partition, offset = last[uuid]
        state = "waiting" if offset >= committed.get((topic, partition), -1) else "committed past"
        places[f"{topic}[{partition}] {state} (commit {committed.get((topic, partition))}, "
               f"end {ends[(topic, partition)]})"] += 1
    return "; ".join(f"{n} in {place}" for place, n in places.most_common())
