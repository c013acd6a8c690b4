"""Where a list's production stands, so a crash or Ctrl-C resumes it instead of starting over.

Rows go to Kafka in batches, each batch's messages keyed ``{run}:{file}:{row}``.
A batch is retired once every message of it is acknowledged; the progress file
then says: every row before (``next_file``, ``next_row``) is in Kafka (or was
reported bad), and every message of a later row that may already be there lies
at or past ``scan_from`` in its partition. Resuming reads inbound_images from
there, collects the rows of this run found delivered, and produces the rest:
no row is lost and none is produced twice, even after a SIGKILL.

``scan_from`` is the lowest offset a message of an unretired batch got (or one
past the last retired one): offsets in a partition only grow, so nothing of a
later row can lie before it.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from common import contracts
from common.kafka import consumer_config


def run_id(files: list[Path], settings: dict[str, Any]) -> str:
    """One list, read one way: the same files (path, size, modification time) and options."""
    described = [[str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns] for path in files]
    return hashlib.sha256(json.dumps([described, settings], sort_keys=True).encode()).hexdigest()[:16]


def message_key(run: str, file_index: int, row: int) -> bytes:
    return f"{run}:{file_index}:{row}".encode()


def save_json_atomically(path: Path, data: object) -> None:
    """A crash mid-write leaves the previous file, never half of one (written aside, synced, renamed)."""
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w") as out:
        json.dump(data, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)


@dataclass
class Progress:
    run: str
    files: list[str]
    next_file: int = 0
    next_row: int = 1               # rows are numbered from 1 within their file
    scan_from: dict[str, int] = field(default_factory=dict)  # partition (as text: JSON) -> offset
    done: bool = False

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_json_atomically(path, asdict(self))

    @classmethod
    def load(cls, path: Path, run: str) -> Progress | None:
        """The saved progress of ``run``; None if there is none (or it is of another run)."""
        try:
            data = json.loads(path.read_text())
            progress = cls(**data)
        except FileNotFoundError:
            return None
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: unreadable progress file ({exc}); delete it or pass --restart") from None
        return progress if progress.run == run else None

    def started(self) -> bool:
        return (self.next_file, self.next_row) > (0, 1) or bool(self.scan_from)


class Batch:
    """One batch of messages in flight: its end position and the offsets its messages got."""

    __slots__ = ("end", "outstanding", "low", "high", "failed")

    def __init__(self, end: tuple[int, int]):
        self.end = end
        self.outstanding = 0
        self.low: dict[int, int] = {}
        self.high: dict[int, int] = {}
        self.failed: list[tuple[bytes, bytes]] = []

    def delivered(self, err: KafkaError | None, message: Message) -> None:
        """librdkafka's delivery report (on the producing thread, inside poll or flush)."""
        if err is not None:
            self.failed.append((message.key() or b"", message.value() or b""))
            return
        self.outstanding -= 1
        partition, offset = message.partition(), message.offset()
        if partition is None or offset is None:
            return
        if offset < self.low.get(partition, offset + 1):
            self.low[partition] = offset
        if offset > self.high.get(partition, -1):
            self.high[partition] = offset


class InFlight:
    """Batches not yet retired, oldest first, and what retiring them lets the progress say."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.batches: list[Batch] = []
        self._retired_high: dict[int, int] = {int(p): o - 1 for p, o in progress.scan_from.items()}

    def add(self, batch: Batch) -> None:
        self.batches.append(batch)

    def retire(self) -> None:
        while self.batches and self.batches[0].outstanding == 0 and not self.batches[0].failed:
            batch = self.batches.pop(0)
            for partition, offset in batch.high.items():
                self._retired_high[partition] = max(offset, self._retired_high.get(partition, -1))
            self.progress.next_file, self.progress.next_row = batch.end
        scan_from = {p: o + 1 for p, o in self._retired_high.items()}
        for batch in self.batches:
            for partition, offset in batch.low.items():
                scan_from[partition] = min(offset, scan_from.get(partition, offset))
        self.progress.scan_from = {str(p): o for p, o in sorted(scan_from.items())}


def inbound_ends(hosts: str, timeout: float = 30.0) -> dict[str, int]:
    """Where inbound_images ends now, per partition: a fresh run's ``scan_from``, saved before
    its first message, so a crash at any moment resumes by the scan. A lagging high
    watermark (tansu's) only makes that scan start earlier, never too late."""
    consumer = Consumer(consumer_config(hosts, "list-producer-ends"))
    try:
        metadata = consumer.list_topics(contracts.INBOUND_TOPIC, timeout=timeout)
        return {str(p): consumer.get_watermark_offsets(TopicPartition(contracts.INBOUND_TOPIC, p), timeout=timeout)[1]
                for p in sorted(metadata.topics[contracts.INBOUND_TOPIC].partitions)}
    finally:
        consumer.close()


def delivered_rows(hosts: str, run: str, scan_from: dict[str, int], timeout: float = 30.0) -> set[tuple[int, int]]:
    """The (file, row) positions of ``run``'s messages in inbound_images from ``scan_from`` on.

    Read until each partition reports its end (``enable.partition.eof``), not up to
    the high watermarks ListOffsets gives: tansu's lag behind what a fetch returns."""
    prefix = f"{run}:".encode()
    consumer = Consumer(consumer_config(hosts, f"list-producer-scan-{run}", **{"enable.partition.eof": True}))
    found: set[tuple[int, int]] = set()
    try:
        metadata = consumer.list_topics(contracts.INBOUND_TOPIC, timeout=timeout)
        partitions = sorted(metadata.topics[contracts.INBOUND_TOPIC].partitions)
        consumer.assign([TopicPartition(contracts.INBOUND_TOPIC, p, scan_from.get(str(p), 0)) for p in partitions])
        left = set(partitions)
        while left:
            for message in consumer.consume(num_messages=10_000, timeout=1.0):
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        left.discard(message.partition())
                        continue
                    raise RuntimeError(f"reading inbound_images to resume: {error}")
                key = message.key() or b""
                if key.startswith(prefix):
                    try:
                        _, file_index, row = key.decode().split(":")
                        found.add((int(file_index), int(row)))
                    except ValueError:  # another producer's key that merely starts alike
                        continue
    finally:
        consumer.close()
    return found
