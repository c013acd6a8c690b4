"""Cancelling tasks that talk to Redis, so that a stop cannot hang.

redis-py's asyncio client (8.1.0 here) now and then swallows a CancelledError
that lands while a command is in flight: the task carries on as if nothing had
happened. Reproduced with a task doing INCRBY and sleeping 50 ms, cancelled at
a random moment: about one cancel in a hundred is lost. A plain ``cancel()``
then ``await`` waits forever (this hung the monitor's dashboard test for 300 s).
Cancelling again at the task's next await point ends it.
"""
from __future__ import annotations

import asyncio
from typing import Any
from collections.abc import Iterable

NUDGE_SECONDS = 0.5


async def cancel_and_wait(tasks: Iterable[asyncio.Future], nudge_every: float = NUDGE_SECONDS) -> list[Any]:
    """Cancel ``tasks``, again every ``nudge_every`` seconds for those still running;
    return their results or exceptions (a ``CancelledError`` for the cancelled), in order."""
    tasks = list(tasks)
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _done, pending = await asyncio.wait(pending, timeout=nudge_every)
    return await asyncio.gather(*tasks, return_exceptions=True)
