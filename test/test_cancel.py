"""A task that swallows its first cancellation, as redis-py's client sometimes does, still ends."""
from __future__ import annotations

import asyncio

from common.cancel import cancel_and_wait


async def swallows_one_cancel(log: list[str]) -> None:
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        log.append("swallowed")  # and carries on, like the library
    while True:
        await asyncio.sleep(0.01)


async def test_a_swallowed_cancellation_is_repeated_until_the_task_ends() -> None:
    log: list[str] = []
    stubborn = asyncio.create_task(swallows_one_cancel(log))
    polite = asyncio.create_task(asyncio.sleep(10))
    finished = asyncio.create_task(asyncio.sleep(0, result="done"))
    await asyncio.sleep(0.01)
    results = await asyncio.wait_for(cancel_and_wait([stubborn, polite, finished], nudge_every=0.05), 2)
    assert log == ["swallowed"]
    assert [type(r).__name__ if isinstance(r, BaseException) else r for r in results] == [
        "CancelledError", "CancelledError", "done"]
