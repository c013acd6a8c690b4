"""The tail every benchmark's site process shares: serve until SIGTERM, then leave the
arrival times where the benchmark reads them (``{log_path}.ready`` says it listens)."""
from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

from aiohttp import web


async def serve_until_stopped(runner: web.AppRunner, log_path: str, arrivals: list[Any]) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    Path(log_path + ".ready").touch()
    await stop.wait()
    Path(log_path).write_text(json.dumps(arrivals))
    await runner.cleanup()
