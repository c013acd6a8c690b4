"""Sample keys and row identifiers (url_lists.dataset.keys): img2dataset's keys, reversible identifiers."""
from __future__ import annotations

import uuid

import pytest

from url_lists.dataset.keys import new_run_id, row_identifier, row_of, sample_key, shard_of

RUN = uuid.UUID("0b9f6a3e-4b0e-4c8e-9d5a-1f2e3d4c5b6a")


@pytest.mark.parametrize("row, per_shard, shard, key", [
    (0, 10_000, 0, "000000000"),
    (9_999, 10_000, 0, "000009999"),
    (10_000, 10_000, 1, "000010000"),
    (123_456, 10_000, 12, "000123456"),
    (5, 100, 0, "000000005"),          # at least four digits for the index
    (250, 100, 2, "000020050"),
    (12_345, 100_000, 0, "0000012345"),  # 99,999 has five digits
    (100_000, 100_000, 1, "0000100000"),
    (7, 1, 7, "000070000"),
])
def test_keys_are_img2datasets(row: int, per_shard: int, shard: int, key: str) -> None:
    assert shard_of(row, per_shard) == shard
    assert sample_key(row, per_shard) == key


@pytest.mark.parametrize("row", [0, 1, 9_999, 10_000, 2**32, 2**63, 2**64 - 1])
def test_an_identifier_gives_its_row_back(row: int) -> None:
    identifier = row_identifier(RUN, row)
    assert str(uuid.UUID(identifier)) == identifier  # a canonical UUID
    assert identifier[:19] == str(RUN)[:19]
    assert row_of(identifier, RUN) == row


@pytest.mark.parametrize("identifier", [
    "", "x", "not-a-uuid", str(RUN).upper(),
    row_identifier(uuid.UUID("1b9f6a3e-4b0e-4c8e-9d5a-1f2e3d4c5b6a"), 3),  # another run
    row_identifier(RUN, 3).upper(), row_identifier(RUN, 3) + "0", row_identifier(RUN, 3)[:-1],
    row_identifier(RUN, 3)[:19] + "0000-00000000000_", row_identifier(RUN, 3)[:19] + "0000-0000000000 3",
    "../../" + row_identifier(RUN, 3),
])
def test_anything_else_is_not_a_row_of_the_run(identifier: str) -> None:
    assert row_of(identifier, RUN) is None


def test_rows_outside_64_bits_are_refused() -> None:
    with pytest.raises(ValueError):
        row_identifier(RUN, -1)
    with pytest.raises(ValueError):
        row_identifier(RUN, 2**64)


def test_runs_differ_in_their_high_bits() -> None:
    runs = {new_run_id().int >> 64 for _ in range(100)}
    assert len(runs) == 100
