"""Row numbers, sample keys and the identifiers a crawl gives its rows.

Rows are numbered from 0 in list order (bad rows included); row ``r`` belongs to
shard ``r // per_shard``. A sample's key is img2dataset's: the shard on five digits,
then the row's index in its shard on as many digits as ``per_shard - 1`` has (at least 4).

A row's identifier (the ``uuid`` of its ``inbound_images`` message) is a UUID made of
the run's high 64 bits and the row number as the low 64: the outcome messages carry it
back, so the collector reads the row from the identifier (no table of identifiers), and
tells this run's outcomes from any other's by the prefix.
"""
from __future__ import annotations

import re
import uuid

MIN_INDEX_DIGITS = 4
_LOW_BITS = 64
_LOW_MASK = (1 << _LOW_BITS) - 1
# "xxxxxxxx-xxxx-xxxx-" holds exactly the high 64 bits of a UUID written in its canonical form.
_PREFIX_CHARS = 19
_LOW_PART = re.compile(r"([0-9a-f]{4})-([0-9a-f]{12})")


def shard_of(row: int, per_shard: int) -> int:
    return row // per_shard


def index_digits(per_shard: int) -> int:
    return max(MIN_INDEX_DIGITS, len(str(max(per_shard - 1, 0))))


def sample_key(row: int, per_shard: int) -> str:
    shard, index = divmod(row, per_shard)
    return f"{shard:05d}{index:0{index_digits(per_shard)}d}"


def new_run_id() -> uuid.UUID:
    return uuid.uuid4()


def row_identifier(run: uuid.UUID, row: int) -> str:
    if not 0 <= row <= _LOW_MASK:
        raise ValueError(f"row {row} is outside 0..2**64-1")
    return str(uuid.UUID(int=(run.int & ~_LOW_MASK) | row))


def run_prefix(run: uuid.UUID) -> str:
    """The text every identifier of ``run`` starts with (its canonical form's high 64 bits)."""
    return str(run)[:_PREFIX_CHARS]


def row_of(identifier: str, run: uuid.UUID) -> int | None:
    """The row ``identifier`` names if it is one of ``run``'s, written as ``row_identifier``
    writes it (canonical, lower case); None for any other string."""
    if not isinstance(identifier, str) or not identifier.startswith(run_prefix(run)):
        return None
    low = _LOW_PART.fullmatch(identifier, _PREFIX_CHARS)
    return None if low is None else int(low.group(1) + low.group(2), 16)
