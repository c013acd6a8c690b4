"""Structured logs: one JSON object a line on stdout, through stdlib ``logging``.

Every line has ``event``, ``time`` and ``level`` (but for the two events whose shape
SPEC.md fixes exactly, ``monitoring_update`` and ``crawl_halted``); the level of each event is data
(``common.contracts.EVENT_LEVELS``, INFO unless named there), so an operator can keep
warnings and errors apart from routine updates (``jq 'select(.level != "info")'``),
and anything else that logs through ``logging`` (a library) comes out as JSON too.
"""
from __future__ import annotations

import json
import logging
import sys
from typing import Any

from common.contracts import EVENT_LEVELS, FIXED_SHAPE_EVENTS, utc_now_iso

LOGGER = logging.getLogger("image_crawler")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        if fields is None:  # a plain logging call from a library
            fields = {"event": "log", "time": utc_now_iso(), "logger": record.name, "msg": record.getMessage()}
        if fields.get("event") not in FIXED_SHAPE_EVENTS:
            fields = {**fields, "level": record.levelname.lower()}
        return json.dumps(fields, default=str)


class _Stdout(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is at the time (pytest swaps it per test)."""

    @property
    def stream(self) -> Any:
        return sys.stdout

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def _configure() -> None:
    handler = _Stdout()
    handler.setFormatter(JsonFormatter())
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.DEBUG)
    LOGGER.propagate = False


_configure()


def log_event(event: str, **fields: Any) -> dict[str, Any]:
    """Log ``{"event", "time", **fields}`` at the event's level; return it for tests."""
    record = {"event": event, "time": utc_now_iso(), **fields}
    LOGGER.log(EVENT_LEVELS.get(event, logging.INFO), event, extra={"fields": record})
    return record
