"""Values read back from Redis, where other processes and operators write them."""
from __future__ import annotations

import math
from typing import Any


def finite_number(raw: Any) -> float | None:
    """A finite float from bytes, text or a number; None for a missing key or junk
    (``abc``, ``nan``, ``inf``): a bad value an operator typed must not stop a process."""
    if raw is None:
        return None
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", errors="replace")
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def count(raw: Any) -> int:
    """A counter's value; 0 when missing or junk."""
    value = finite_number(raw)
    return int(value) if value is not None else 0


def non_negative(raw: Any) -> float | None:
    """A rate or a time: finite and at least 0, else None."""
    value = finite_number(raw)
    return value if value is not None and value >= 0 else None


def as_text(value: bytes | str) -> str:
    """A reply as text, whether or not the client decodes responses."""
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value
