"""Input shards (url_lists.dataset.inputs): written whole, read back, listed."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from url_lists.dataset.inputs import (INPUT_COLUMNS, additional_columns, input_path, input_shards,
                                      read_input_shard, write_input_shard)


def table(rows: list[int], extra: bool = True) -> pa.Table:
    data = {"row": rows, "key": [f"{r:09d}" for r in rows], "url": [f"http://a.test/{r}.jpg" for r in rows],
            "caption": [f"cap {r}" for r in rows], "status": ["accepted"] * len(rows),
            "bad_reason": [None] * len(rows), "source_file": ["list.parquet"] * len(rows),
            "source_row": [r + 1 for r in rows]}
    if extra:
        data["license"] = ["cc-by"] * len(rows)
    return pa.table(data)


def test_a_shard_is_written_and_read_back(tmp_path: Path) -> None:
    write_input_shard(tmp_path, 3, table([30, 31]))
    back = read_input_shard(tmp_path, 3)
    assert back.column("row").to_pylist() == [30, 31]
    assert tuple(back.schema.names[:len(INPUT_COLUMNS)]) == INPUT_COLUMNS
    assert additional_columns(back) == ["license"]
    assert input_path(tmp_path, 3).name == "00003.parquet"
    assert not [p for p in input_path(tmp_path, 3).parent.iterdir() if p.name.startswith(".")]


def test_shards_are_listed_in_order_and_temporaries_ignored(tmp_path: Path) -> None:
    for shard in (2, 0, 11):
        write_input_shard(tmp_path, shard, table([shard]))
    (input_path(tmp_path, 0).parent / ".00005.parquet.tmp").write_bytes(b"half")
    assert input_shards(tmp_path) == [0, 2, 11]
    assert input_shards(tmp_path / "nowhere") == []


def test_a_table_without_the_columns_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="caption"):
        write_input_shard(tmp_path, 0, table([1]).drop_columns(["caption"]))
