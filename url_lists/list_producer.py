"""``python -m url_lists.list_producer URL_LIST...``: schedule a crawl from any URL list.

The lists img2dataset reads (txt, csv, tsv, json, jsonl, parquet; paths, globs
or folders) with its option names (``--input-format``, ``--url-col``; the
underscore spellings work too). Without ``--id-col`` each URL's identifier is
derived from it (stable: the same list gives the same identifiers); without
``--source-col`` its source is its site, the registrable domain, and the
producer publishes each site's count of URLs in ``list_source_sizes`` for the
monitor to rate it by (SPEC.md §2, §3). It streams (memory holds one batch),
shows rows a second and the ETA on a terminal, reports each bad row by file
and row number without stopping, and resumes where it stopped: run the same
command again after a crash or Ctrl-C (``--restart`` produces the list anew).
The exit status is 0 once every good row is in Kafka, 1 if delivery failed,
2 for a list or setting that cannot be used, 130 when interrupted.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import sys
import time
from collections import Counter, deque
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from pathlib import Path
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

import pyarrow.parquet as pq
from confluent_kafka import KafkaException, Producer
from redis import Redis, RedisError
from tqdm import tqdm

from common import contracts
from common.jsonlog import log_event
from common.kafka import ensure_topics, produce_waiting, producer_config
from common.contracts import INBOUND_PARTITIONS
from common.settings import load_settings
from url_lists.progress import (Batch, InFlight, Progress, delivered_rows, inbound_ends, message_key,
                                              run_id)
from url_lists.readers import Batch as ReadBatch
from url_lists.readers import FORMATS, BadFile, Columns, expand, format_of, read_batches
from url_lists.rows import Converted, convert_batch, start_pool_process

T = TypeVar("T")
SAVE_SECONDS = 1.0            # how often the progress file is rewritten while producing
COUNTED_TTL_SECONDS = 30 * 86400  # a list's counted mark outlives any resume of it
FLUSH_SECONDS = 10.0
# Messages the Kafka client may hold unacknowledged: a second of the producer's rate, and the
# bound on its memory (~30 MiB) whatever the list's length or the broker's pace.
QUEUED_MESSAGES = 100_000
# A list shorter than this is converted on the producer's own thread: ~36 µs a row there on a slow
# 2-core machine (3.6 s for the lot) against ~0.9 s of CPU to start a pool of two (docs/decisions.md).
POOL_MIN_ROWS = 100_000
# KEYS: the sizes hash, the run's counted mark; ARGV: the new mark, its expiry, then source, count pairs.
COUNT = """
for i = 3, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
return 1
"""


class Interrupted(Exception):
    """SIGINT or SIGTERM: stop reading, deliver what is queued, save the progress."""


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise Interrupted()


def total_rows(files: list[Path], formats: list[str]) -> int | None:
    """Rows for the progress bar: Parquet's own count, lines for the text formats
    (a fast pass over the bytes); None where neither says (a json array)."""
    total = 0
    for path, kind in zip(files, formats, strict=True):
        if kind == "parquet":
            try:
                total += pq.ParquetFile(path).metadata.num_rows
            except Exception:  # noqa: BLE001 - the reader reports a bad file properly
                return None
        elif kind == "json":
            return None
        else:
            with path.open("rb") as raw:
                lines = sum(chunk.count(b"\n") for chunk in iter(lambda: raw.read(1 << 20), b""))
            total += max(0, lines - (kind in ("csv", "tsv")))
    return total


class SizeCounter:
    """Adds each derived source's URLs to ``list_source_sizes``, each row once per list."""

    def __init__(self, redis: Redis, run: str):
        self._redis = redis
        self._script = redis.register_script(COUNT)
        self._key = contracts.list_counted_key(run)
        raw = redis.get(self._key)
        text = raw.decode() if isinstance(raw, bytes) else str(raw or "0 0")
        file_index, _, row = text.partition(" ")
        self.counted = (int(file_index), int(row))  # rows before this were counted by an earlier run

    def add(self, counts: Counter[str], end: tuple[int, int]) -> None:
        if end <= self.counted:
            return
        args: list[str | int] = [f"{end[0]} {end[1]}", COUNTED_TTL_SECONDS]
        for source, count in counts.items():
            args += [source, count]
        self._script(keys=[contracts.LIST_SOURCE_SIZES, self._key], args=args)
        self.counted = end


class ListProducer:
    """Reads the files in order, converts their rows in a process pool (in order, a few
    batches ahead) and sends the good ones, batch by batch."""

    def __init__(self, producer: Producer, pool: Executor, files: list[Path], formats: list[str],
                 columns: Columns, progress: Progress, sizes: SizeCounter | None,
                 already: set[tuple[int, int]], bar: tqdm, ahead: int):
        self._producer = producer
        self._pool = pool
        self._files = files
        self._formats = formats
        self._columns = columns
        self.progress = progress
        self._sizes = sizes
        self._already = already
        self._bar = bar
        self._ahead = ahead
        self.in_flight = InFlight(progress)
        self.failed = 0
        self.sent = 0       # by this run of the command
        self.bad_rows = 0

    def run(self, progress_path: Path) -> None:
        saved = time.monotonic()
        with_id, with_source = self._columns.id is not None, self._columns.source is not None
        pending: deque[tuple[int, ReadBatch, Future[Converted]]] = deque()
        for file_index in range(self.progress.next_file, len(self._files)):
            skip = self.progress.next_row - 1 if file_index == self.progress.next_file else 0
            for batch in read_batches(self._files[file_index], self._formats[file_index], self._columns, skip):
                pending.append((file_index, batch, self._pool.submit(
                    convert_batch, batch.values, batch.errors, batch.first_row, with_id, with_source)))
                batch.values = []  # the pool process has its copy
                while len(pending) > self._ahead:
                    self._send_batch(*pending.popleft())
                if time.monotonic() - saved >= SAVE_SECONDS:
                    self.settle(progress_path)
                    saved = time.monotonic()
            pending.append((file_index, ReadBatch("", 0), _end_of_file()))
        while pending:
            self._send_batch(*pending.popleft())
        self.finish(progress_path)

    def _send_batch(self, file_index: int, batch: ReadBatch, future: Future[Converted]) -> None:
        if not batch.path:  # the end of a file: the position moves to the next one
            self.in_flight.add(Batch((file_index + 1, 1)))
            return
        converted = future.result()
        for row, reason in converted.bad:
            self.bad_rows += 1
            log_event(contracts.EVENT_LIST_BAD_ROW, file=batch.path, row=row, error=reason)
        end = (file_index, batch.first_row + batch.rows)
        if self._sizes is not None and end > self._sizes.counted:
            counted = self._sizes.counted
            counts = Counter(source for row, source in zip(converted.rows, converted.sources, strict=True)
                             if (file_index, row) >= counted)
            self._sizes.add(counts, end)  # before the URLs: the monitor knows the site when they arrive
        run, already, producer = self.progress.run, self._already, self._producer
        to_send = [(row, value) for row, value in zip(converted.rows, converted.messages, strict=True)
                   if not already or (file_index, row) not in already]
        in_flight = Batch(end)
        # Counted in full before the first produce: a batch cut short (Ctrl-C) never retires.
        in_flight.outstanding = len(to_send)
        self.in_flight.add(in_flight)
        for row, value in to_send:
            # A full local queue is waited out (delivery reports free room), never dropped.
            produce_waiting(producer, contracts.INBOUND_TOPIC, value, message_key(run, file_index, row),
                            in_flight.delivered)
            self.sent += 1
        self._producer.poll(0)
        self._bar.update(batch.rows)

    def settle(self, progress_path: Path) -> None:
        """Serve delivery reports, resend what failed, retire what is done, save."""
        self._producer.poll(0)
        for batch in self.in_flight.batches:
            if batch.failed:
                failed, batch.failed = batch.failed, []
                self.failed += len(failed)
                for key, value in failed:
                    produce_waiting(self._producer, contracts.INBOUND_TOPIC, value, key, batch.delivered)
        self.in_flight.retire()
        self.progress.save(progress_path)

    def finish(self, progress_path: Path, deadline: float | None = None) -> bool:
        """Wait until every message is acknowledged (or ``deadline``, monotonic, passes)."""
        while True:
            wait = FLUSH_SECONDS if deadline is None else min(FLUSH_SECONDS, max(0.0, deadline - time.monotonic()))
            self._producer.flush(wait)
            self.settle(progress_path)
            if not self.in_flight.batches:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False


class InProcess(Executor):
    """``--processes-count 0``: rows converted on the producer's own thread, no pool."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        done: Future[T] = Future()
        done.set_result(fn(*args, **kwargs))
        return done


def pool_processes(asked: int | None, rows_left: int | None, cores: int) -> int:
    """Processes to convert rows in: as asked, else one per core unless the list is known short."""
    if asked is not None:
        return asked
    if rows_left is not None and rows_left < POOL_MIN_ROWS:
        return 0
    return cores


def _pool(processes: int) -> Executor:
    if processes == 0:
        return InProcess()
    # Spawned, so each is the producer's own child and dies with it (start_pool_process); a
    # forkserver's children hold its liveness pipe open, so neither would notice the producer's death.
    return ProcessPoolExecutor(processes, multiprocessing.get_context("spawn"), initializer=start_pool_process,
                               initargs=(os.getpid(),))


def _end_of_file() -> Future[Converted]:
    done: Future[Converted] = Future()
    done.set_result(Converted())
    return done


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m url_lists.list_producer",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("url_list", nargs="+", metavar="URL_LIST",
                        help="files, globs (quote them) or folders; read in the order given, each glob sorted")
    parser.add_argument("--input-format", "--input_format", choices=FORMATS,
                        help="the lists' format (default: from each file's extension)")
    parser.add_argument("--url-col", "--url_col", default="url", help="the column of URLs (default: url)")
    parser.add_argument("--id-col", "--id_col",
                        help="the column of identifiers (default: one derived from the URL, stable)")
    parser.add_argument("--source-col", "--source_col",
                        help="the column of source names (default: each URL's registrable domain)")
    parser.add_argument("--processes-count", "--processes_count", type=int,
                        help="processes that parse and check the URLs (default: one per core, none for a list "
                             f"of fewer than {POOL_MIN_ROWS:,} rows; 0: none, the producer's own thread does it)")
    parser.add_argument("--kafka-hosts", help="bootstrap servers (default: KAFKA_HOSTS)")
    parser.add_argument("--progress-file", type=Path,
                        help="where the progress is kept for a resume (default: .list_producer/RUN.json)")
    parser.add_argument("--restart", action="store_true",
                        help="produce the whole list again, ignoring the progress saved")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = load_settings()
    hosts = args.kafka_hosts or settings.kafka_hosts
    columns = Columns(url=args.url_col, id=args.id_col, source=args.source_col)
    try:
        files = expand(args.url_list, args.input_format)
        formats = [format_of(path, args.input_format) for path in files]
    except BadFile as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.processes_count is not None and args.processes_count < 0:
        print("error: --processes-count must be 0 or more", file=sys.stderr)
        return 2
    if any(kind == "txt" for kind in formats) and (columns.id or columns.source):
        print("error: a txt list has only URLs: --id-col and --source-col need another format", file=sys.stderr)
        return 2
    run = run_id(files, {"formats": formats, "url": columns.url, "id": columns.id, "source": columns.source})
    progress_path = args.progress_file or Path(".list_producer") / f"{run}.json"
    previous = signal.signal(signal.SIGTERM, _interrupt)
    redis: Redis | None = None
    producer_obj: ListProducer | None = None
    try:
        progress = None if args.restart else Progress.load(progress_path, run)
        if progress is not None and progress.done:
            log_event(contracts.EVENT_LIST_PRODUCED, run=run, files=len(files), sent=0, bad_rows=0,
                      msg=f"already produced (see {progress_path}); --restart produces it again")
            return 0
        ensure_topics(hosts, [contracts.INBOUND_TOPIC], INBOUND_PARTITIONS)
        already: set[tuple[int, int]] = set()
        if progress is None:
            progress = Progress(run, [str(path) for path in files], scan_from=inbound_ends(hosts))
            progress.save(progress_path)
        else:
            already = delivered_rows(hosts, run, progress.scan_from)
        sizes = None
        if columns.source is None:
            redis = Redis.from_url(settings.redis_url, decode_responses=True)
            sizes = SizeCounter(redis, run)
        log_event(contracts.EVENT_LIST_STARTED, run=run, files=len(files), progress_file=str(progress_path),
                  resumed_at={"file": progress.next_file, "row": progress.next_row} if progress.started() else None,
                  delivered_before_crash=len(already))
        producer = Producer(producer_config(hosts, **{"linger.ms": 50, "enable.idempotence": True,
                                                      "queue.buffering.max.messages": QUEUED_MESSAGES}))
        total = total_rows(files, formats)
        done_before = 0 if total is None else _rows_before(files, formats, progress)
        processes = pool_processes(args.processes_count, None if total is None else total - done_before,
                                   os.cpu_count() or 1)
        with tqdm(total=total, initial=done_before, unit="rows", unit_scale=True, smoothing=0.1,
                  disable=not sys.stderr.isatty()) as bar, \
                _pool(processes) as pool:
            producer_obj = ListProducer(producer, pool, files, formats, columns, progress, sizes, already, bar,
                                        ahead=2 * max(1, processes))
            producer_obj.run(progress_path)
        progress.done = True
        progress.save(progress_path)
    except Interrupted:
        return _interrupted(producer_obj, progress_path)
    except KeyboardInterrupt:
        return _interrupted(producer_obj, progress_path)
    except (BadFile, OSError, KafkaException, RedisError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
        if redis is not None:
            redis.close()
    assert producer_obj is not None
    log_event(contracts.EVENT_LIST_PRODUCED, run=run, files=len(files), sent=producer_obj.sent,
              bad_rows=producer_obj.bad_rows, resent=producer_obj.failed, progress_file=str(progress_path))
    return 0


def _rows_before(files: list[Path], formats: list[str], progress: Progress) -> int:
    before = total_rows(files[:progress.next_file], formats[:progress.next_file]) or 0
    return before + max(0, progress.next_row - 1)


def _interrupted(producer: ListProducer | None, progress_path: Path) -> int:
    """Deliver what is queued (briefly), save where it stands: the same command resumes."""
    if producer is not None:
        delivered = producer.finish(progress_path, deadline=time.monotonic() + FLUSH_SECONDS)
        progress = producer.progress
        log_event(contracts.EVENT_LIST_INTERRUPTED, run=progress.run, sent=producer.sent,
                  next_file=progress.next_file, next_row=progress.next_row, all_queued_delivered=delivered,
                  msg=f"run the same command again to resume (progress in {progress_path})")
    return 130


if __name__ == "__main__":
    sys.exit(main())
