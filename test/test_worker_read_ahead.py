"""Records read past the memory bound and left in Kafka (worker.intake.read_ahead): kept as ranges,
taken on the second reading, and the commit held below the first of them."""
from __future__ import annotations

import pytest
from worker.intake.offsets import PartitionOffsets
from worker.intake.read_ahead import FastMarks, LeftBehind, past_the_bound, pause_short_of_the_bound

TP0, TP1 = ("urls", 0), ("urls", 1)


def test_a_run_of_left_records_is_one_range_and_taking_one_splits_it() -> None:
    left = LeftBehind()
    for offset in [*range(10, 20), *range(25, 30)]:
        left.leave(TP0, offset)
    left.leave(TP0, 12)  # read again while still past the bound: left once
    left.leave(TP1, 7)
    assert (left.count(TP0), left.spans(), len(left)) == (15, 3, 16)
    assert left.rewind() == {TP0: 10, TP1: 7}
    assert left.holds(TP0, 19) and not left.holds(TP0, 20) and not left.holds(TP0, 9)
    assert left.take(TP0, 15) and not left.take(TP0, 15) and not left.take(TP0, 22)
    assert (left.count(TP0), left.spans()) == (14, 4)
    assert left.take(TP0, 10) and left.first(TP0) == 11
    for offset in [*range(11, 15), *range(16, 20), *range(25, 30)]:
        assert left.take(TP0, offset)
    assert left.first(TP0) is None and left.rewind() == {TP1: 7}
    left.leave(TP0, 20)
    left.leave(TP0, 22)
    left.leave(TP0, 21)  # fills the gap: one range again
    assert left.spans() == 2 and left.count(TP0) == 3
    left.forget([TP0, TP1])
    assert len(left) == 0 and left.rewind() == {}


def test_the_commit_stays_below_what_was_left_and_read_marks_what_is_new() -> None:
    offsets = PartitionOffsets()
    offsets.add(0)
    offsets.passed(1)  # left in Kafka
    offsets.held_back = 1
    offsets.add(2)
    offsets.finish(0)
    offsets.finish(2)
    assert offsets.committable() == 1  # not past the left one, though 2 is finished
    assert offsets.seen(2) and not offsets.seen(3)
    offsets.add(1)  # taken on the second reading
    offsets.held_back = None
    assert offsets.committable() == 1
    offsets.finish(1)
    assert offsets.committable() == 3


def test_a_fast_sources_mark_moves_on_as_its_partition_is_read_past_it_and_survives_other_seeks() -> None:
    marks = FastMarks()
    for offset in range(100, 110):
        marks.read(TP0, offset)
        if offset in (103, 105):
            marks.left(TP0, "fast", offset)  # its queue full
    assert marks.marks(TP0) == {"fast": 103}
    marks.sought(TP0, 103)  # read again for it: 103 taken, 105 left again, read on to 120
    for offset in range(103, 121):
        marks.read(TP0, offset)
        if offset == 105:
            marks.left(TP0, "fast", offset)
    assert marks.marks(TP0) == {"fast": 105}
    marks.sought(TP0, 0)  # every partition read again from what it left: the mark stays
    assert marks.marks(TP0) == {"fast": 105}
    for offset in range(0, 50):  # paused before it reaches the mark: still there
        marks.read(TP0, offset)
    assert marks.marks(TP0) == {"fast": 105}
    marks.sought(TP0, 105)
    for offset in range(105, 130):  # all taken this time: the mark is past what was read
        marks.read(TP0, offset)
    assert marks.marks(TP0) == {"fast": 130}
    marks.drop(TP0, ["fast"])
    assert marks.partitions() == []


@pytest.mark.parametrize("held, was_past, past", [
    (8_999, False, False),  # MAX_QUEUED_URLS 10,000 less FAST_ROOM (10%): 9,000
    (9_000, False, True),
    (9_000, True, True),
    (5_001, True, True),    # past it until half has gone
    (5_000, True, False),
    (5_001, False, False),
])
def test_past_the_bound_from_the_bound_less_the_fast_room_until_half_has_gone(
        held: int, was_past: bool, past: bool) -> None:
    assert past_the_bound(held, 10_000, was_past) is past


@pytest.mark.parametrize("held, pausing, pause", [
    (7_499, False, False),  # SLOW_PARTITIONS_PAUSE_AT: 75% of MAX_QUEUED_URLS 10,000
    (7_500, False, True),
    (7_499, True, True),    # paused until half has gone
    (5_001, True, True),
    (5_000, True, False),
])
def test_short_of_the_bound_the_partitions_feeding_no_fast_source_pause_from_three_quarters_until_half(
        held: int, pausing: bool, pause: bool) -> None:
    assert pause_short_of_the_bound(held, 10_000, pausing) is pause
