"""``python -m url_lists.export OUT_DIR``: the crawl's results as files, one row per URL.

Reads the output topics (``image_metadata_updates``, ``link_rot``,
``crawl_errors``, ``opted_out``) into Parquet shards (``--output-format jsonl`` for JSON lines),
``part-00000.parquet``, ``part-00001.parquet``..., each row a URL's identifier,
outcome, the error's reason and status, width, height, JPEG quality, file size,
EXIF (as JSON), X-Robots-Tag, the thumbnail's S3 key, and an opt-out's signal and value
(``url_lists.results``).
Without ``--follow`` it reads what is there when it starts and stops; with it,
it keeps reading, writing a shard every ``--shard-rows`` rows or
``--shard-seconds`` seconds. Run it again, or after a crash, and it resumes:
``OUT_DIR/_export_state.json`` says where each partition was written up to, and
is saved only after a shard is in place, so no outcome is lost or written
twice. (A URL crawled twice, which at-least-once delivery allows after a worker
crash, has two rows.)
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from common import contracts
from common.jsonlog import log_event
from common.kafka import consumer_config, ensure_topics
from common.offset_gaps import OffsetGaps, assigned_at, consume_whole
from common.contracts import INBOUND_PARTITIONS
from common.settings import load_settings
from url_lists.progress import save_json_atomically
from url_lists.results import SCHEMA, Joiner

TOPICS = contracts.OUTCOME_TOPICS
STATE_FILE = "_export_state.json"
FORMATS = ("parquet", "jsonl")
EXPORT_GROUP = "image_crawler_export"  # never joined nor committed to: partitions are assigned


class Stop(Exception):
    """SIGINT or SIGTERM: write what is read, save the state, stop."""


def _stop(_signum: int, _frame: FrameType | None) -> None:
    raise Stop()


@dataclass
class ExportState:
    """Per partition (``topic:partition``): ``written``, the offset up to which its outcomes are in
    shards; ``resume``, where reading starts again (lower while an EXIF message waits for its
    quality message). ``next_shard`` numbers the next file."""

    next_shard: int = 0
    written: dict[str, int] = field(default_factory=dict)
    resume: dict[str, int] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> ExportState:
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            return cls()
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: unreadable export state ({exc})") from None

    def save(self, path: Path) -> None:
        save_json_atomically(path, asdict(self))


def _name(topic: str, partition: int) -> str:
    return f"{topic}:{partition}"


class Exporter:
    def __init__(self, consumer: Consumer, out_dir: Path, output_format: str, shard_rows: int,
                 shard_seconds: float):
        self._consumer = consumer
        self._gaps = OffsetGaps()
        self._out = out_dir
        self._format = output_format
        self._shard_rows = shard_rows
        self._shard_seconds = shard_seconds
        self._state_path = out_dir / STATE_FILE
        self.state = ExportState.load(self._state_path)
        self._joiner = Joiner()
        self._rows: list[dict[str, Any]] = []
        self._read: dict[str, int] = {}  # partition -> next offset read
        self.rows_written = 0
        self.shards_written = 0

    @property
    def unreadable(self) -> int:
        """Messages on the output topics that were not JSON with an identifier."""
        return self._joiner.unreadable

    def assign(self, partitions: dict[str, int]) -> set[str]:
        """Start each partition where the state says; return the partitions to read to their end."""
        assignment = []
        for topic, count in partitions.items():
            for partition in range(count):
                name = _name(topic, partition)
                start = self.state.resume.get(name, 0)
                low, _ = self._consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
                if start < low:  # the broker dropped what was not read (retention): say so, go on
                    log_event(contracts.EVENT_EXPORT_GAP, partition=name, missing=low - start,
                              msg="the broker no longer holds these outcomes (retention); they are not exported")
                    start = low
                self._read[name] = start
                assignment.append(TopicPartition(topic, partition, start))
        self._consumer.assign(assignment)
        assigned_at(self._gaps, assignment)
        return set(self._read)

    def run(self, partitions: set[str], follow: bool) -> None:
        """Without ``follow``, until each partition reports its end (``enable.partition.eof``;
        tansu's ListOffsets high watermarks lag behind what a fetch returns)."""
        shard_started = time.monotonic()
        left = set(partitions)
        while follow or left:
            for message in consume_whole(self._consumer, self._gaps, 5_000, 0.5):
                topic, partition, offset = message.topic(), message.partition(), message.offset()
                if topic is None or partition is None or offset is None:
                    continue
                name = _name(topic, partition)
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        left.discard(name)
                    continue
                self._read[name] = offset + 1
                row = self._joiner.feed(topic, partition, offset, message.value())
                if row is not None and offset >= self.state.written.get(name, 0):
                    self._rows.append(row)
                    if len(self._rows) >= self._shard_rows:
                        self.write_shard()
                        shard_started = time.monotonic()
            if follow and self._rows and time.monotonic() - shard_started >= self._shard_seconds:
                self.write_shard()
                shard_started = time.monotonic()
        self.write_shard()

    def write_shard(self) -> None:
        """The rows read so far as the next shard, then the state that points past them."""
        if self._rows:
            path = self._out / f"part-{self.state.next_shard:05d}.{self._format}"
            # A leading dot: readers of the folder (pyarrow's datasets skip "." and "_" files)
            # see each shard whole or not at all, even while --follow writes the next one.
            temporary = path.with_name(f".{path.name}.tmp")
            if self._format == "parquet":
                pq.write_table(pa.Table.from_pylist(self._rows, schema=SCHEMA), temporary)
            else:
                with temporary.open("w") as out:
                    out.writelines(json.dumps(_json_row(row)) + "\n" for row in self._rows)
            with temporary.open("rb") as written:
                os.fsync(written.fileno())
            os.replace(temporary, path)
            log_event(contracts.EVENT_EXPORT_SHARD, path=str(path), rows=len(self._rows))
            self.rows_written += len(self._rows)
            self.shards_written += 1
            self.state.next_shard += 1
            self._rows = []
        for name, offset in self._read.items():
            topic, _, partition = name.rpartition(":")
            self.state.written[name] = max(offset, self.state.written.get(name, 0))
            resume = offset
            if topic == contracts.METADATA_TOPIC:
                self._joiner.expire(int(partition), offset)
                waiting = self._joiner.oldest_pending(int(partition))
                resume = offset if waiting is None else min(offset, waiting)
            self.state.resume[name] = resume
        self.state.save(self._state_path)


def _json_row(row: dict[str, Any]) -> dict[str, Any]:
    """Every column, EXIF as an object rather than JSON text (a JSON line holds it as it is)."""
    out = {name: row.get(name) for name in SCHEMA.names}
    if out["exif"] is not None:
        out["exif"] = json.loads(out["exif"])
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m url_lists.export", description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    parser.add_argument("--output-format", "--output_format", choices=FORMATS, default="parquet")
    parser.add_argument("--follow", action="store_true", help="keep reading as the crawl goes on (Ctrl-C stops)")
    parser.add_argument("--shard-rows", type=int, default=100_000, help="rows per shard (default 100,000)")
    parser.add_argument("--shard-seconds", type=float, default=60.0,
                        help="with --follow, a shard at least this often while outcomes come (default 60)")
    parser.add_argument("--kafka-hosts", help="bootstrap servers (default: KAFKA_HOSTS)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = load_settings()
    hosts = args.kafka_hosts or settings.kafka_hosts
    if args.shard_rows < 1 or args.shard_seconds <= 0:
        print("error: --shard-rows and --shard-seconds must be positive", file=sys.stderr)
        return 2
    previous = {signum: signal.signal(signum, _stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    consumer: Consumer | None = None
    exporter: Exporter | None = None
    try:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        ensure_topics(hosts, TOPICS, INBOUND_PARTITIONS)
        consumer = Consumer(consumer_config(hosts, EXPORT_GROUP, **{"enable.partition.eof": True}))
        metadata = consumer.list_topics(timeout=10)
        partitions = {topic: len(metadata.topics[topic].partitions) for topic in TOPICS}
        exporter = Exporter(consumer, args.out_dir, args.output_format, args.shard_rows, args.shard_seconds)
        exporter.run(exporter.assign(partitions), args.follow)
    except Stop:
        if exporter is not None:
            exporter.write_shard()
    except (OSError, KafkaException, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if consumer is not None:
            consumer.close()
    if exporter is not None:
        log_event(contracts.EVENT_EXPORT_STOPPED, out_dir=str(args.out_dir), rows=exporter.rows_written,
                  shards=exporter.shards_written, unreadable=exporter.unreadable)
    return 0


if __name__ == "__main__":
    sys.exit(main())
