"""Gaps in a partition's offsets, read again before they are believed.

tansu 0.6 (the local broker) moves a partition's high watermark before it stores the
batch (``dynostore`` produce): while two produce requests to one partition are in flight, a
fetch at the log's end can get the later batch without the earlier one, and the consumer
moves past records it never saw. Apache Kafka shows a gap only for transaction markers
or compaction, which this crawler's topics do not have. So a record past the offset
expected is held back and its partition read again from that offset, until the missing
records come or the gap has stood GAP_REREADS reads and GAP_SECONDS; then it is believed
(``kafka_offset_gap``). docs/decisions.md, "Records a tailing consumer never saw".
Not thread-safe: one per consumer, used on the consumer's thread.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition

from common.contracts import EVENT_KAFKA_OFFSET_GAP
from common.jsonlog import log_event

GAP_REREADS = 3      # reads again of a gap at least...
GAP_SECONDS = 1.0    # ... and for this long, before it is believed

TP = tuple[str, int]


class OffsetGaps:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._next: dict[TP, int] = {}                 # offset expected next, where known
        self._gaps: dict[TP, tuple[int, float]] = {}  # a gap not yet believed: (reads again, first seen)
        self.rereads = 0  # partitions sought back to a gap, in all

    def moved(self, tp: TP, offset: int | None) -> None:
        """The consumer was placed at ``offset`` (a seek or an assignment; None: not known)."""
        self._gaps.pop(tp, None)
        if offset is None or offset < 0:
            self._next.pop(tp, None)
        else:
            self._next[tp] = offset

    def forget(self, tps: Iterable[TP]) -> None:
        """These partitions were revoked or assigned anew: their next offset is not known."""
        for tp in tps:
            self.moved(tp, None)

    def admit(self, messages: list[Message]) -> tuple[list[Message], dict[TP, int]]:
        """The messages to hand on, and the partitions to read again from an offset: past a
        gap not yet believed, a partition's messages are held back."""
        kept: list[Message] = []
        reread: dict[TP, int] = {}
        for message in messages:
            topic, partition, offset = message.topic(), message.partition(), message.offset()
            if message.error() is not None or topic is None or partition is None or offset is None or offset < 0:
                kept.append(message)
                continue
            tp = (topic, partition)
            if tp in reread:
                continue
            expected = self._next.get(tp)
            if expected is not None and offset > expected and not self._believed(tp, expected, offset):
                reread[tp] = expected
                self.rereads += 1
                continue
            self._gaps.pop(tp, None)
            self._next[tp] = offset + 1
            kept.append(message)
        return kept, reread

    def _believed(self, tp: TP, expected: int, offset: int) -> bool:
        now = self._clock()
        reads, since = self._gaps.get(tp, (0, now))
        if reads >= GAP_REREADS and now - since >= GAP_SECONDS:
            log_event(EVENT_KAFKA_OFFSET_GAP, topic=tp[0], partition=tp[1], expected=expected, got=offset,
                      reads=reads, seconds=round(now - since, 2))
            return True
        self._gaps[tp] = (reads + 1, since)
        return False


def consume_whole(consumer: Consumer, gaps: OffsetGaps, num_messages: int, timeout: float) -> list[Message]:
    """``consumer.consume``, with each partition's messages handed on without a gap (above):
    a partition past one is sought back to it."""
    kept, reread = gaps.admit(consumer.consume(num_messages=num_messages, timeout=timeout))
    for (topic, partition), offset in reread.items():
        try:
            consumer.seek(TopicPartition(topic, partition, offset))
        except KafkaException:  # revoked meantime: its next owner reads it from the commit
            gaps.moved((topic, partition), None)
    return kept


def assigned_at(gaps: OffsetGaps, parts: Iterable[TopicPartition]) -> None:
    """Tell ``gaps`` where an assignment with explicit offsets places each partition."""
    for part in parts:
        gaps.moved((part.topic, part.partition), part.offset if part.offset >= 0 else None)
