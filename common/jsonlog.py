"""Structured logs: one JSON object a line, so the monitor's log is machine-readable."""
from __future__ import annotations

import json
import sys
import threading
from typing import IO, Any

from common.contracts import utc_now_iso

_lock = threading.Lock()


def log_event(event: str, stream: IO[str] | None = None, **fields: Any) -> dict[str, Any]:
    """Write ``{"event", "time", **fields}`` as one line; return it for tests."""
    record = {"event": event, "time": utc_now_iso(), **fields}
    line = json.dumps(record, default=str)
    with _lock:
        out = stream or sys.stdout
        out.write(line + "\n")
        out.flush()
    return record
