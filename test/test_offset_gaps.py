"""A partition's records come without a gap the broker did not mean (common/offset_gaps.py)."""
from __future__ import annotations

import json

import pytest
from confluent_kafka import TopicPartition

from common.contracts import EVENT_KAFKA_OFFSET_GAP
from common.offset_gaps import GAP_REREADS, GAP_SECONDS, OffsetGaps, assigned_at, consume_whole


class Msg:
    def __init__(self, partition: int, offset: int, topic: str = "t", error: object = None):
        self._where, self._error = (topic, partition, offset), error

    def topic(self) -> str:
        return self._where[0]

    def partition(self) -> int:
        return self._where[1]

    def offset(self) -> int:
        return self._where[2]

    def error(self) -> object:
        return self._error


def offsets(messages: list) -> list[tuple[int, int]]:
    return [(m.partition(), m.offset()) for m in messages]


@pytest.mark.parametrize(("placed", "batch", "kept", "reread"), [
    # no offset expected yet: the first record sets it
    (None, [(0, 7), (0, 8)], [(0, 7), (0, 8)], {}),
    # one after another
    (7, [(0, 7), (0, 8), (0, 9)], [(0, 7), (0, 8), (0, 9)], {}),
    # a jump: the partition's records from there are held back, read again from 9
    (7, [(0, 7), (0, 8), (0, 10), (0, 11)], [(0, 7), (0, 8)], {("t", 0): 9}),
    # a gap at the start of the batch, another partition unaffected
    (7, [(0, 9), (1, 3), (0, 10), (1, 4)], [(1, 3), (1, 4)], {("t", 0): 7}),
    # a record before the one expected (a seek back it was not told of): handed on
    (7, [(0, 5), (0, 6)], [(0, 5), (0, 6)], {}),
])
def test_admit(placed, batch, kept, reread) -> None:
    gaps = OffsetGaps(clock=lambda: 0.0)
    gaps.moved(("t", 0), placed)
    out, again = gaps.admit([Msg(p, o) for p, o in batch])
    assert offsets(out) == kept and again == reread


def test_error_events_pass_and_a_revoked_partition_expects_nothing() -> None:
    gaps = OffsetGaps(clock=lambda: 0.0)
    gaps.moved(("t", 0), 7)
    eof = Msg(0, 12, error="_PARTITION_EOF")
    out, again = gaps.admit([eof])
    assert out == [eof] and again == {}
    gaps.forget([("t", 0)])
    out, again = gaps.admit([Msg(0, 20)])
    assert offsets(out) == [(0, 20)] and again == {}


def test_a_gap_is_believed_only_after_its_reads_and_seconds(capsys) -> None:
    now = [0.0]
    gaps = OffsetGaps(clock=lambda: now[0])
    gaps.moved(("t", 0), 5)
    for _ in range(GAP_REREADS + 2):  # read again at once: not yet its seconds
        assert gaps.admit([Msg(0, 8)]) == ([], {("t", 0): 5})
    now[0] = GAP_SECONDS
    out, again = gaps.admit([Msg(0, 8), Msg(0, 9)])
    assert offsets(out) == [(0, 8), (0, 9)] and again == {}
    logged = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(e["event"], e["expected"], e["got"]) for e in logged] == [(EVENT_KAFKA_OFFSET_GAP, 5, 8)]
    assert offsets(gaps.admit([Msg(0, 10)])[0]) == [(0, 10)]


class RacyConsumer:
    """A broker showing a later batch before an earlier one: offsets 3-4 come only when read again."""

    def __init__(self) -> None:
        self.log = {0: [0, 1, 2, 5, 6]}
        self.position = {0: 0}
        self.seeks: list[tuple[int, int]] = []

    def consume(self, num_messages: int, timeout: float) -> list[Msg]:
        out = [Msg(p, o) for p, log in self.log.items() for o in log if o >= self.position[p]][:num_messages]
        for m in out:
            self.position[m.partition()] = m.offset() + 1
        return out

    def seek(self, part: TopicPartition) -> None:
        self.seeks.append((part.partition, part.offset))
        self.position[part.partition] = part.offset
        self.log[part.partition] = sorted({*self.log[part.partition], 3, 4})  # the late batch is stored now


def test_consume_whole_reads_a_gap_again_and_hands_on_every_record_once() -> None:
    consumer = RacyConsumer()
    gaps = OffsetGaps(clock=lambda: 0.0)
    assigned_at(gaps, [TopicPartition("t", 0, 0)])
    first = consume_whole(consumer, gaps, 100, 0.1)
    second = consume_whole(consumer, gaps, 100, 0.1)
    assert offsets(first) == [(0, 0), (0, 1), (0, 2)]
    assert consumer.seeks == [(0, 3)] and gaps.rereads == 1
    assert offsets(second) == [(0, 3), (0, 4), (0, 5), (0, 6)]
