"""Small fakes for the dataset collector's I/O: outcome messages, thumbnails, limits; and a list to crawl."""
from __future__ import annotations

import io
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
from PIL import Image

from common import contracts
from url_lists.dataset.inputs import write_input_shard
from url_lists.dataset.keys import row_identifier, sample_key
from url_lists.dataset.sources import Record, partition_name

RUN = uuid.UUID("0b9f6a3e-4b0e-4c8e-9d5a-1f2e3d4c5b6a")
TOPICS = (contracts.METADATA_TOPIC, contracts.LINK_ROT_TOPIC, contracts.CRAWL_ERRORS_TOPIC)


def jpeg(width: int = 32, height: int = 24, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "JPEG", quality=85)
    return out.getvalue()


class FakeOutcomes:
    """Partitions of messages, read from the offsets asked; more may be appended while read."""

    def __init__(self, partitions: int = 2):
        self.logs: dict[str, list[bytes]] = {partition_name(t, p): [] for t in TOPICS for p in range(partitions)}
        self.partitions = partitions
        self.position: dict[str, int] = {}
        self.closed = False

    def add(self, topic: str, message: dict[str, Any], partition: int | None = None) -> None:
        if partition is None:
            partition = sum(str(message.get("identifier")).encode()) % self.partitions
        self.logs.setdefault(partition_name(topic, partition), []).append(json.dumps(message).encode())

    def start(self, saved: dict[str, int], since: float) -> dict[str, int]:
        self.position = {name: saved.get(name, 0) for name in self.logs}
        return dict(self.position)

    def poll(self, max_messages: int, timeout: float) -> list[Record]:
        out = []
        for name, log in self.logs.items():
            topic, _, partition = name.rpartition(":")
            while self.position.setdefault(name, 0) < len(log) and len(out) < max_messages:
                offset = self.position[name]
                out.append(Record(topic, int(partition), offset, log[offset]))
                self.position[name] += 1
        if not out:
            time.sleep(min(timeout, 0.01))
        return out

    def close(self) -> None:
        self.closed = True


class FakeThumbnails:
    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.gets = 0

    async def get(self, identifier: str) -> bytes | None:
        self.gets += 1
        return self.objects.get(identifier)


class FakeLimits:
    def __init__(self, limit: float | None = 10.0):
        self.limit = limit

    async def limit_sum(self) -> float | None:
        return self.limit

    async def close(self) -> None:
        pass


def input_table(rows: range, per_shard: int, bad: dict[int, str] | None = None) -> pa.Table:
    bad = bad or {}
    return pa.table({
        "row": pa.array(list(rows), pa.int64()),
        "key": [sample_key(r, per_shard) for r in rows],
        "url": [None if r in bad else f"http://site{r % 3}.test/{r}.jpg" for r in rows],
        "caption": [f"caption {r}" for r in rows],
        "status": ["bad" if r in bad else "accepted" for r in rows],
        "bad_reason": [bad.get(r) for r in rows],
        "source_file": ["list.parquet"] * len(rows),
        "source_row": pa.array([r + 1 for r in rows], pa.int64()),
        "license": [f"lic{r}" for r in rows],
    })


def write_list(folder: Path, rows: int, per_shard: int, bad: dict[int, str] | None = None) -> list[int]:
    """The input shards of a list of ``rows`` rows; returns the shards."""
    shards = []
    for shard, start in enumerate(range(0, rows, per_shard)):
        write_input_shard(folder, shard, input_table(range(start, min(rows, start + per_shard)), per_shard, bad))
        shards.append(shard)
    return shards


def success(outcomes: FakeOutcomes, thumbnails: FakeThumbnails | None, row: int, width: int = 800,
            height: int = 600, exif: dict[str, Any] | None = None, tags: list[str] | None = None,
            run: uuid.UUID = RUN, **extra: Any) -> None:
    identifier = row_identifier(run, row)
    partition = row % outcomes.partitions
    if exif is not None:
        outcomes.add(contracts.METADATA_TOPIC, {"identifier": identifier, "exif": exif}, partition)
    outcomes.add(contracts.METADATA_TOPIC, {"identifier": identifier, "width": width, "height": height,
                                            "compression_quality": 90, "filesize": 1234,
                                            "x_robots_tag": tags or [], **extra}, partition)
    if thumbnails is not None:
        thumbnails.objects[identifier] = jpeg(32, 24, (row % 255, 10, 10))


def link_rot(outcomes: FakeOutcomes, row: int, run: uuid.UUID = RUN) -> None:
    outcomes.add(contracts.LINK_ROT_TOPIC, {"identifier": row_identifier(run, row), "time": "2026-01-01T00:00:00"})


def error(outcomes: FakeOutcomes, row: int, reason: str, status: int | None, run: uuid.UUID = RUN,
          **extra: Any) -> None:
    outcomes.add(contracts.CRAWL_ERRORS_TOPIC, {
        "identifier": row_identifier(run, row), "url": f"http://site{row % 3}.test/{row}.jpg",
        "source": f"site{row % 3}.test", "reason": reason, "status": status, "attempts": 0,
        "time": "2026-01-01T00:00:00", **extra})
