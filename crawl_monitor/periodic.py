"""A fixed-schedule loop for the monitor's once-a-second and once-every-5-s jobs."""
from __future__ import annotations

import asyncio
from typing import Any
from collections.abc import Awaitable, Callable

from common.jsonlog import log_event
from common.contracts import EVENT_MONITOR_COMPONENT_ERROR


class Fatal(Exception):
    """Raised by a step whose failure must end the loop, and with it the monitor."""


async def every(seconds: float, step: Callable[[], Awaitable[Any]], component: str) -> None:
    """Run ``step`` every ``seconds`` until cancelled or until it raises ``Fatal``.

    Any other failing step (Redis down, say) is logged and the next one runs on time:
    the monitor must outlive a broken connection, and while it cannot write,
    the buckets expire and the crawl stops by itself. Runs missed by a stalled
    loop are skipped rather than caught up, so a stall never becomes a burst.
    """
    loop = asyncio.get_running_loop()
    next_run = loop.time()
    while True:
        try:
            await step()
        except Fatal:
            raise
        except Exception as exc:  # noqa: BLE001 - one failure must not end the monitor
            log_event(EVENT_MONITOR_COMPONENT_ERROR, component=component, error=f"{type(exc).__name__}: {exc}")
        next_run += seconds
        delay = next_run - loop.time()
        if delay < 0:
            next_run, delay = loop.time(), 0.0
        await asyncio.sleep(delay)
