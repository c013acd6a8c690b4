"""The worker's byte budget for bodies in hand (SegmentPool.wait_for_room)."""
from __future__ import annotations

import asyncio
import gc

import pytest

from worker.constants import SEGMENT_STEP
from worker.fetching.shared_memory import Body, SegmentPool


async def test_a_download_waits_while_bodies_in_hand_hold_the_budget() -> None:
    pool = SegmentPool(4 * SEGMENT_STEP)
    held = [Body(0, pool.take(), pool) for _ in range(2)]
    for body in held:
        body.segment.window(0)  # one step backed, as the first bytes of a body would
    assert pool.held_bytes == 2 * SEGMENT_STEP
    waiting = asyncio.create_task(pool.wait_for_room(2 * SEGMENT_STEP))
    await asyncio.sleep(0.05)
    assert not waiting.done(), "a new download started past the budget"
    held.pop().release()  # the image pool took one
    await asyncio.wait_for(waiting, 1.0)
    assert pool.held_bytes == SEGMENT_STEP
    held.pop().release()
    pool.close()


async def test_a_segment_dropped_without_being_given_back_stops_counting() -> None:
    pool = SegmentPool(2 * SEGMENT_STEP)
    segment = pool.take()
    segment.window(0)
    assert pool.held_bytes == SEGMENT_STEP
    segment.close()
    del segment
    gc.collect()
    assert pool.held_bytes == 0
    await asyncio.wait_for(pool.wait_for_room(1), 0.5)


@pytest.mark.parametrize("raw", ["0", "12", "-1", "lots"])
def test_the_budget_setting_is_checked(raw: str) -> None:
    from common.settings import Settings, SettingsError
    with pytest.raises(SettingsError, match="BODY_BUDGET_BYTES"):
        Settings.from_env({"BODY_BUDGET_BYTES": raw})
