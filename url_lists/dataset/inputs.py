"""Input shards: a list's rows as numbered, one Parquet file per output shard.

``{folder}/_crawl/inputs/{shard:05d}.parquet`` is written (whole, synced, renamed) before
any row of its shard is produced, so the collector can always join an outcome to its row's
URL, caption and additional columns, and knows every row a shard must account for.
"""
from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from url_lists.dataset.files import fsync_path, publish, temporary_name

CRAWL_DIR = "_crawl"
INPUTS_DIR = "inputs"
# The columns every input shard starts with; the list's additional columns follow, as read.
INPUT_SCHEMA = pa.schema([
    ("row", pa.int64()),
    ("key", pa.string()),
    ("url", pa.string()),          # as read; null if missing
    ("caption", pa.string()),
    ("status", pa.string()),       # "accepted" or "bad"
    ("bad_reason", pa.string()),
    ("source_file", pa.string()),
    ("source_row", pa.int64()),    # the n-th record of its file
])
INPUT_COLUMNS = tuple(INPUT_SCHEMA.names)
ACCEPTED, BAD = "accepted", "bad"
_SHARD_FILE = re.compile(r"(\d{5,})\.parquet")


def inputs_dir(folder: Path) -> Path:
    return folder / CRAWL_DIR / INPUTS_DIR


def input_path(folder: Path, shard: int) -> Path:
    return inputs_dir(folder) / f"{shard:05d}.parquet"


def additional_columns(table: pa.Table | pa.Schema) -> list[str]:
    schema = table.schema if isinstance(table, pa.Table) else table
    return [name for name in schema.names if name not in INPUT_COLUMNS]


def write_input_shard(folder: Path, shard: int, table: pa.Table) -> None:
    missing = [name for name in INPUT_COLUMNS if name not in table.schema.names]
    if missing:
        raise ValueError(f"an input shard needs the columns {', '.join(missing)}")
    path = input_path(folder, shard)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_name(path)
    pq.write_table(table, temporary)
    fsync_path(temporary)
    publish(temporary, path)


def read_input_shard(folder: Path, shard: int, columns: list[str] | None = None) -> pa.Table:
    return pq.read_table(input_path(folder, shard), columns=columns)


def input_shards(folder: Path) -> list[int]:
    directory = inputs_dir(folder)
    if not directory.is_dir():
        return []
    found = (_SHARD_FILE.fullmatch(path.name) for path in directory.iterdir())
    return sorted(int(match.group(1)) for match in found if match)
