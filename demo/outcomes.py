"""Which terminal outcome each scheduled uuid got, read from the output topics.

SPEC.md §1: every inbound URL ends in exactly one of a quality message (an
``image_metadata_updates`` message with ``width``), ``link_rot``,
``crawl_errors`` or ``opted_out``. At-least-once delivery may repeat an outcome, so outcomes
are counted per uuid and kind: a repeat is a duplicate, two kinds a conflict.
The collector keeps every message about its uuids (EXIF messages too) so
the demo can write the results out.
"""
from __future__ import annotations

import json
import time
import uuid as uuidlib
from collections import Counter, defaultdict
from typing import Any
from collections.abc import Callable, Iterable

from confluent_kafka import Consumer, TopicPartition

from common.contracts import CRAWL_ERRORS_TOPIC, LINK_ROT_TOPIC, METADATA_TOPIC, OPTED_OUT_TOPIC
from common.contracts import OUTCOME_TOPICS
from common.kafka import consumer_config, coordinates, ensure_topics
from common.offset_gaps import OffsetGaps, consume_whole

QUALITY = "quality"
# Those kinds are named after their topics.
LINK_ROT, CRAWL_ERRORS, OPTED_OUT = LINK_ROT_TOPIC, CRAWL_ERRORS_TOPIC, OPTED_OUT_TOPIC
TOPIC_KIND = {LINK_ROT_TOPIC: LINK_ROT, CRAWL_ERRORS_TOPIC: CRAWL_ERRORS, OPTED_OUT_TOPIC: OPTED_OUT}


def outcome_kind(topic: str, message: dict[str, Any]) -> str | None:
    """The terminal kind a message stands for; None for an EXIF message."""
    if topic == METADATA_TOPIC:
        return QUALITY if "width" in message else None
    return TOPIC_KIND.get(topic)


class Outcomes:
    """A consumer of the outcome topics in a group of its own, from the beginning."""

    def __init__(self, kafka_hosts: str, wanted: Iterable[str], partitions: int = 4):
        self.wanted = set(wanted)
        self.kinds: dict[str, Counter[str]] = defaultdict(Counter)
        self.messages: dict[str, list[dict[str, Any]]] = {topic: [] for topic in OUTCOME_TOPICS}
        self.unparseable: list[tuple[str, bytes]] = []
        # Offsets within a partition are consecutive here (no transactions, no compaction), so a
        # jump that stood its reads again (common.offset_gaps) means records this reader never
        # got: (topic, partition, expected offset, got offset).
        self.gaps: list[tuple[str, int, int, int]] = []
        self._offset_gaps = OffsetGaps()
        self.found_at: dict[str, tuple[str, int, int]] = {}  # uuid -> where its first outcome was
        self._next_offset: dict[tuple[str, int], int] = {}
        # Subscribing to a topic nobody has created yet would wait a metadata refresh.
        ensure_topics(kafka_hosts, OUTCOME_TOPICS, partitions)
        self._consumer = Consumer(consumer_config(
            kafka_hosts, f"outcomes-{uuidlib.uuid4().hex}", **{"enable.partition.eof": False}))
        self._consumer.subscribe(list(OUTCOME_TOPICS), on_assign=self._assigned)

    def _assigned(self, consumer: Consumer, parts: list[TopicPartition]) -> None:
        self._offset_gaps.forget((part.topic, part.partition) for part in parts)
        consumer.assign(parts)

    def poll(self, timeout: float = 1.0) -> int:
        """Read what has arrived; returns how many wanted uuids got their first outcome."""
        before = len(self.kinds)
        for msg in consume_whole(self._consumer, self._offset_gaps, 1000, timeout):
            if msg.error():
                continue
            topic, partition, offset = coordinates(msg)
            expected = self._next_offset.get((topic, partition))
            if expected is not None and offset > expected:
                self.gaps.append((topic, partition, expected, offset))
            self._next_offset[(topic, partition)] = offset + 1
            try:
                message = json.loads(msg.value())
                identifier = message["identifier"]
            except (ValueError, TypeError, KeyError):
                self.unparseable.append((msg.topic(), msg.value()))
                continue
            if identifier not in self.wanted:
                continue
            self.messages[msg.topic()].append(message)
            kind = outcome_kind(msg.topic(), message)
            if kind:
                self.kinds[identifier][kind] += 1
                self.found_at.setdefault(identifier, (topic, partition, offset))
        return len(self.kinds) - before

    def wait(self, timeout: float, on_poll: Callable[[int], None] | None = None,
             until: int | None = None) -> bool:
        """Poll until ``until`` uuids (default: all) have an outcome or ``timeout`` passes.
        ``on_poll`` gets each poll's count of new outcomes (for a progress bar) and may raise
        to give up. Returns whether the count was reached."""
        target = len(self.wanted) if until is None else until
        deadline = time.monotonic() + timeout
        while len(self.kinds) < target and time.monotonic() < deadline:
            # A poll returns once 1,000 messages came or its timeout passed: the last outcome
            # was seen up to that late, and a bench's end-to-end time counted it.
            new = self.poll(0.1)
            if on_poll is not None:
                on_poll(new)
        return len(self.kinds) >= target

    @property
    def done(self) -> bool:
        return len(self.kinds) >= len(self.wanted)

    def next_offsets(self) -> dict[tuple[str, int], int]:
        """(topic, partition) -> the offset after the last one this reader got."""
        return dict(self._next_offset)

    def missing(self) -> set[str]:
        return self.wanted - set(self.kinds)

    def conflicts(self) -> dict[str, Counter[str]]:
        """Uuids with two different terminal kinds."""
        return {u: k for u, k in self.kinds.items() if len(k) > 1}

    def duplicates(self) -> int:
        return sum(sum(k.values()) - 1 for k in self.kinds.values())

    def kind_of(self, identifier: str) -> str | None:
        kinds = self.kinds.get(identifier)
        return next(iter(kinds)) if kinds else None

    def totals(self) -> Counter[str]:
        return Counter(kind for kinds in self.kinds.values() for kind in kinds)

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> Outcomes:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
