"""The collector: the crawl's outcomes on Kafka and thumbnails in S3 (or THUMBNAIL_DIR's folder),
written as dataset shards.

Each outcome message of this run (``keys.row_of``) finishes its row: a success's thumbnail
is fetched from S3 (many at once) or read from the folder and written with the row's caption and columns into its
shard's output as it comes (``writers.py``); every row is also appended to its shard's
journal. A shard is published (renamed into place, its stats file last) once every row of
its input shard has an outcome; with a folder, the shard's thumbnail files are deleted once
it is published (not before: a shard rebuilt from its journal reads them again). Outcomes
may come in any order and more than once: the first one of a row counts, later ones are
passed over.

Crash safety (a SIGKILL at any instant): a shard with its ``{shard}_stats.json`` is
complete; any other shard's outputs are temporary and are rebuilt from its journal (its
successes' thumbnails fetched again). The Kafka offsets saved in ``_crawl/collector.json``
never pass a message whose row is not yet durable (journal synced, or its shard published),
so a rerun reads every outcome it has not kept, and the first-wins rule drops those it has.

Memory: the open shards (an input shard's rows and finished set each, a writer's buffer of
at most 256 rows or 8 MiB) and at most ``MAX_FETCHES`` thumbnails in flight; not the list's
length. Kafka's blocking calls run on a thread of their own, disk syncs and publications
on another, in order.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from common import contracts
from common.hosts import InvalidHost
from common.jsonlog import log_event
from common.settings import Settings
from url_lists.dataset import inputs
from url_lists.dataset.files import fsync_path, publish, temporary_name
from url_lists.dataset.images import fit_image
from url_lists.dataset.journal import Journal, journal_path, read_journal
from url_lists.dataset.keys import row_identifier, shard_of
from url_lists.dataset.outcomes import (ERROR, SUCCESS, THUMBNAIL_MISSING, OutcomeReader,
                                        bad_row_outcome)
from url_lists.dataset.sources import KafkaOutcomes, LimitSource, OutcomeSource, Record, RedisLimits, partition_name
from url_lists.dataset.s3 import StoreUnavailable
from url_lists.dataset.stats import MAX_BAD_ROWS_LISTED, TOP_SITES, RateWindow, Tally, shard_stats, summary_lines
from url_lists.dataset.writers import (OUTCOME_FIELDS, ShardWriter, discard_leftovers, extra_columns, row_schema,
                                       shard_writer, stats_path)
from url_lists.rows import url_origin_of
from url_lists.sites import site_of_host
from url_lists.tsv_producer import with_scheme
from worker.imaging.thumbnails import ThumbnailFolder

STATE_FILE = "collector.json"
STATS_FILE = "stats.json"
RUN_FILE = "run.json"
POLL_MESSAGES = 2_000
POLL_TIMEOUT = 0.2
SYNC_INTERVAL = 0.5        # seconds between two journal syncs (and saves of the offsets)
MAX_FETCHES = 256          # thumbnails being fetched (or waiting for a connection) at once
DATA_SYNC_BYTES = 4 << 20   # an open shard's images are synced in the background past this, not at its end
LIMITS_INTERVAL = 5.0      # seconds between two reads of the sites' limits
FETCH_RETRY_FIRST, FETCH_RETRY_MAX = 0.5, 30.0
# A fresh run reads the outcome topics from this long before its run.json was written:
# its rows are produced after, and a clock a little off must not lose the first outcomes.
START_MARGIN = 300.0
_OUTCOME_NAMES = [f.name for f in OUTCOME_FIELDS]


@dataclass(frozen=True)
class DatasetOptions:
    folder: Path
    output_format: str  # "webdataset" | "parquet" | "files"
    per_shard: int
    image_size: int
    run: uuid.UUID


@dataclass(frozen=True)
class Progress:
    rows_expected: int
    outcomes: int
    successes: int
    link_rot: int
    errors: int


class _Shard:
    """An open shard: its input rows, which have finished, its writer, journal and tally."""

    def __init__(self, options: DatasetOptions, shard: int, journaled: dict[int, dict[str, Any]]):
        table = inputs.read_input_shard(options.folder, shard).combine_chunks()
        self.shard = shard
        self.extra = extra_columns(table.schema)  # input name -> output name
        # Kept as Arrow arrays, read a value at a time: half the memory of Python lists.
        self._values = [("key", _array(table, "key")), ("url", _array(table, "url")),
                        ("caption", _array(table, "caption"))]
        self._values += [(out, _array(table, name)) for name, out in self.extra.items()]
        numbers = table.column("row").to_pylist()
        self._bad = [(row, bad_row_outcome(reason, source_file, source_row)) for row, status, reason, source_file,
                     source_row in zip(numbers, *(table.column(name).to_pylist() for name in (
                         "status", "bad_reason", "source_file", "source_row")), strict=True)
                     if status == inputs.BAD]
        # Rows numbered in a run (the usual case) need no table from row to position.
        contiguous = numbers == list(range(numbers[0], numbers[0] + len(numbers))) if numbers else True
        self.index: range | dict[int, int] = range(numbers[0], numbers[0] + len(numbers)) if numbers and \
            contiguous else {row: i for i, row in enumerate(numbers)}
        self.finished: set[int] = set()
        self.fetching: set[int] = set()
        self.thumbnails: list[str] = []  # identifiers of the thumbnails written into its output
        discard_leftovers(options.folder, shard)
        self.writer: ShardWriter = shard_writer(options.output_format, options.folder, shard,
                                                row_schema(table.schema))
        self.journal = Journal(journal_path(options.folder, shard))
        self.journaled = journaled
        self.tally = Tally()
        self.started = time.time()

    @property
    def size(self) -> int:
        return len(self.index)

    def identity(self, row: int) -> dict[str, Any]:
        i = self.index.index(row) if isinstance(self.index, range) else self.index[row]
        return {name: values[i].as_py() for name, values in self._values}

    def bad_rows(self) -> list[tuple[int, dict[str, Any]]]:
        bad, self._bad = self._bad, []
        return bad

    @property
    def complete(self) -> bool:
        return len(self.finished) == self.size


def _array(table: pa.Table, name: str) -> pa.Array:
    column = table.column(name)
    return column.chunk(0) if column.num_chunks == 1 else pa.concat_arrays(column.chunks)


def _site(url: Any) -> str | None:
    try:
        return site_of_host(url_origin_of(with_scheme(url.strip())).host) if isinstance(url, str) else None
    except (contracts.InvalidMessage, InvalidHost, ValueError):
        return None


class Collector:
    def __init__(self, options: DatasetOptions, settings: Settings, *, outcomes: OutcomeSource | None = None,
                 thumbnails: Any = None, limits: LimitSource | None = None) -> None:
        """``outcomes``, ``thumbnails`` (an object with ``async get(identifier) -> bytes | None``)
        and ``limits`` default to Kafka, S3 (THUMBNAIL_DIR's folder if set) and Redis from ``settings``."""
        if options.per_shard < 1:
            raise ValueError("per_shard must be at least 1")
        self.options = options
        self._settings = settings
        self._outcomes = outcomes
        self._thumbnails = thumbnails
        # Deletes a published shard's thumbnails (a folder's files; S3's objects are kept).
        self._folder: ThumbnailFolder | None = thumbnails if isinstance(thumbnails, ThumbnailFolder) else None
        self._limits = limits
        self._crawl_dir = options.folder / inputs.CRAWL_DIR
        self._crawl_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._tally = Tally(max_bad_listed=MAX_BAD_ROWS_LISTED)
        self._completed: dict[int, int] = {}   # shard -> its rows, for every published shard
        self._load_folder()
        self._shards: dict[int, _Shard] = {}
        self._expected: set[int] = set()
        self._expected_rows = 0
        self._input_done = False
        self._reader = OutcomeReader(options.run)
        self._next: dict[str, int] = {}                 # partition -> next offset to read
        self._pending: dict[str, dict[int, None]] = {}  # partition -> offsets whose rows are not durable yet
        self._unreleased: list[tuple[str, int]] = []    # finished rows' messages, durable at the next sync
        self._orphans: dict[int, dict[int, tuple[dict[str, Any], str, int]]] = {}  # shard with no input yet
        self._rate = RateWindow()
        self._crawled = 0  # outcomes of this run's messages (not replays nor bad rows): the rate's count
        self._progress = self._snapshot()
        self._failure: BaseException | None = None

    # --- the interface ------------------------------------------------------------------
    def finished_rows(self) -> set[int]:
        """Rows whose outcome is durable in the output folder: every row of a published shard,
        the journaled and bad rows of the others."""
        rows: set[int] = set()
        for shard in inputs.input_shards(self.options.folder):
            if shard in self._completed:
                rows.update(inputs.read_input_shard(self.options.folder, shard, ["row"]).column("row").to_pylist())
                continue
            table = inputs.read_input_shard(self.options.folder, shard, ["row", "status"])
            statuses = table.column("status").to_pylist()
            rows.update(row for row, status in zip(table.column("row").to_pylist(), statuses, strict=True)
                        if status == inputs.BAD)
            rows.update(read_journal(journal_path(self.options.folder, shard)))
        return rows

    def expect(self, shard: int) -> None:
        self._requests.put(shard)

    def no_more_shards(self) -> None:
        self._requests.put(None)

    def progress(self) -> Progress:
        return self._progress

    def run(self, stop: threading.Event) -> None:
        asyncio.run(self._main(stop))

    def summary(self) -> dict[str, Any]:
        with self._lock:
            totals = self._tally.as_dict(top_sites=TOP_SITES)
            expected = self._expected_rows
        return {
            "run": str(self.options.run), "output_format": self.options.output_format,
            "rows_read": expected, "totals": totals,
            "shards_complete": len(self._completed), "shards_open": len(self._shards),
            "rate": self._rate.as_dict(),
        }

    def summary_lines(self) -> list[str]:
        return summary_lines(self.summary())

    # --- the folder -----------------------------------------------------------------------
    def _load_folder(self) -> None:
        for shard in inputs.input_shards(self.options.folder):
            path = stats_path(self.options.folder, shard)
            if path.exists():
                try:
                    stats = json.loads(path.read_text())
                except ValueError:
                    stats = None  # cut short before its rename: not possible, but rebuild rather than trust it
                if isinstance(stats, dict):
                    self._completed[shard] = int(stats.get("count", 0))
                    self._tally.merge(stats)
                    journal_path(self.options.folder, shard).unlink(missing_ok=True)

    def _state_path(self) -> Path:
        return self._crawl_dir / STATE_FILE

    def _saved_offsets(self) -> dict[str, int]:
        try:
            state = json.loads(self._state_path().read_text())
        except FileNotFoundError:
            return {}
        if state.get("run") != str(self.options.run):
            return {}
        return {str(k): int(v) for k, v in state.get("offsets", {}).items()}

    def _run_started(self) -> float:
        try:
            return (self._crawl_dir / RUN_FILE).stat().st_mtime - START_MARGIN
        except FileNotFoundError:
            return time.time() - START_MARGIN

    def save_offsets(self, offsets: dict[str, int]) -> None:
        """Per partition, where a resumed run reads from: written whole, then renamed into place."""
        path = self._state_path()
        temporary = temporary_name(path)
        with temporary.open("w") as out:
            json.dump({"run": str(self.options.run), "offsets": offsets}, out)
            out.flush()
            fsync_path(temporary)
        publish(temporary, path)

    def _safe_offsets(self) -> dict[str, int]:
        """Per partition, the offset before which every message's row is durable (or not ours)."""
        safe = {}
        for name, next_offset in self._next.items():
            offset = next_offset
            pending = self._pending.get(name)
            if pending:
                offset = min(offset, min(pending))
            topic, _, partition = name.rpartition(":")
            if topic == contracts.METADATA_TOPIC:
                waiting = self._reader.joiner.oldest_pending(int(partition))
                if waiting is not None:
                    offset = min(offset, waiting)
            safe[name] = offset
        return safe

    # --- the loop ------------------------------------------------------------------------
    async def _main(self, stop: threading.Event) -> None:
        loop = asyncio.get_running_loop()
        self._disk = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dataset-disk")
        kafka_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dataset-kafka")
        self._tasks: set[asyncio.Task[None]] = set()
        self._fetches = asyncio.Semaphore(MAX_FETCHES)
        self._room = asyncio.Event()  # set when fetches in flight fell to half the most
        self._last_sync = 0.0
        self._sync_task: asyncio.Task[None] | None = None
        closers = []
        try:
            source = self._outcomes
            if source is None:
                source = await loop.run_in_executor(kafka_thread, KafkaOutcomes, self._settings.kafka_hosts,
                                                    contracts.OUTCOME_TOPICS)
                closers.append(source.close)
            if self._thumbnails is None and self._settings.thumbnail_dir:
                self._thumbnails = self._folder = ThumbnailFolder(Path(self._settings.thumbnail_dir))
            if self._thumbnails is None:
                from url_lists.dataset.s3 import s3_thumbnail_reader
                reader_context = s3_thumbnail_reader(self._settings)
                self._thumbnails = await reader_context.__aenter__()
            else:
                reader_context = None
            limits = self._limits
            if limits is None:
                from common.redis_client import bounded_redis
                limits = RedisLimits(bounded_redis(self._settings.redis_url, 2))
            saved = self._saved_offsets()
            starts = await loop.run_in_executor(kafka_thread, source.start, saved, self._run_started())
            self._next.update(starts)
            if starts != saved:
                await loop.run_in_executor(self._disk, self.save_offsets, dict(starts))
            limits_task = asyncio.create_task(self._watch_limits(limits, stop))
            try:
                await self._collect(source, kafka_thread, stop)
            finally:
                limits_task.cancel()
                await asyncio.gather(limits_task, return_exceptions=True)
                await limits.close()
                if reader_context is not None:
                    await reader_context.__aexit__(None, None, None)
                    self._thumbnails = None
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._sync_task is not None:
                await asyncio.gather(self._sync_task, return_exceptions=True)
            try:
                await self._sync()
            finally:
                for shard in self._shards.values():
                    shard.journal.close()
                    shard.writer.discard()  # rebuilt from its journal by the next run
                self._shards.clear()
                for close in closers:
                    await loop.run_in_executor(kafka_thread, close)
                kafka_thread.shutdown(wait=True)
                self._disk.shutdown(wait=True)
                self._write_summary()

    async def _collect(self, source: OutcomeSource, kafka_thread: ThreadPoolExecutor, stop: threading.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            self._take_requests()
            if self._failure is not None:
                raise self._failure
            if self._input_done and all(shard in self._completed for shard in self._expected) \
                    and not self._tasks:
                return
            if len(self._tasks) >= MAX_FETCHES:
                self._room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), POLL_TIMEOUT)
            else:
                records = await loop.run_in_executor(kafka_thread, source.poll, POLL_MESSAGES, POLL_TIMEOUT)
                for record in records:
                    self._handle(record)
            if time.monotonic() - self._last_sync >= SYNC_INTERVAL and (self._sync_task is None
                                                                        or self._sync_task.done()):
                if self._sync_task is not None:
                    self._sync_task.result()  # raises what the last one raised
                self._last_sync = time.monotonic()
                self._sync_task = asyncio.create_task(self._sync())
            self._progress = self._snapshot()
        if self._failure is not None:
            raise self._failure

    def _take_requests(self) -> None:
        while True:
            try:
                shard = self._requests.get_nowait()
            except queue.Empty:
                return
            if shard is None:
                self._input_done = True
                continue
            if shard in self._expected:
                continue
            self._expected.add(shard)
            state = None if shard in self._completed else self._open(shard)
            if state is None and shard not in self._completed:
                raise FileNotFoundError(f"shard {shard} is expected but has no input shard "
                                        f"({inputs.input_path(self.options.folder, shard)})")
            with self._lock:
                self._expected_rows += self._completed[shard] if state is None else state.size

    def _open(self, shard: int) -> _Shard | None:
        """The open shard (opened now if need be: rebuilt from its journal); None without an input shard."""
        state = self._shards.get(shard)
        if state is not None or shard in self._completed:
            return state
        if not inputs.input_path(self.options.folder, shard).exists():
            return None
        state = _Shard(self.options, shard, read_journal(journal_path(self.options.folder, shard)))
        self._shards[shard] = state
        for row, outcome in state.bad_rows():
            self._finish(state, row, outcome, None, journal=False)
        for row, outcome in state.journaled.items():  # what a previous run finished: rebuilt
            if row in state.index and row not in state.finished:
                self._start(state, row, outcome, None, journal=False)
        state.journaled = {}
        for row, (outcome, name, offset) in self._orphans.pop(shard, {}).items():
            self._pending[name].pop(offset, None)
            self._accept(state, row, outcome, name, offset)
        self._complete_if_done(state)
        return state

    def _handle(self, record: Record) -> None:
        name = partition_name(record.topic, record.partition)
        self._next[name] = record.offset + 1
        found = self._reader.feed(record.topic, record.partition, record.offset, record.value)
        if found is None:
            if record.topic == contracts.METADATA_TOPIC and record.offset % 1000 == 0:
                self._reader.joiner.expire(record.partition, record.offset)
            return
        row, outcome, first = found  # first: the offset of its first message (EXIF, then quality)
        shard = shard_of(row, self.options.per_shard)
        if shard in self._completed:
            return
        state = self._open(shard)
        if state is None:  # its input shard is not written yet: held until it is
            orphans = self._orphans.setdefault(shard, {})
            if row not in orphans:
                orphans[row] = (outcome, name, first)
                self._pending.setdefault(name, {})[first] = None
            return
        self._accept(state, row, outcome, name, first)

    def _accept(self, state: _Shard, row: int, outcome: dict[str, Any], name: str, offset: int) -> None:
        if row not in state.index or row in state.finished or row in state.fetching:
            return  # not a row of the list, or a repeated outcome: the first counts
        self._pending.setdefault(name, {})[offset] = None
        self._crawled += 1
        if self._crawled == 1:  # the rate counts from the first outcome, not from the next look
            self._rate.look(time.monotonic(), 1, None)
        self._start(state, row, outcome, (name, offset), journal=True)

    def _start(self, state: _Shard, row: int, outcome: dict[str, Any], message: tuple[str, int] | None,
               journal: bool) -> None:
        if outcome.get("status") == SUCCESS:
            state.fetching.add(row)
            task = asyncio.create_task(self._fetch(state, row, outcome, message, journal))
            self._tasks.add(task)
            task.add_done_callback(self._fetched)
        else:
            self._finish(state, row, outcome, None, journal, message)

    def _fetched(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if len(self._tasks) < MAX_FETCHES // 2:
            self._room.set()
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()

    async def _fetch(self, state: _Shard, row: int, outcome: dict[str, Any], message: tuple[str, int] | None,
                     journal: bool) -> None:
        identifier = row_identifier(self.options.run, row)
        delay = FETCH_RETRY_FIRST
        async with self._fetches:
            while True:
                try:
                    image = await self._thumbnails.get(identifier)
                    break
                except (StoreUnavailable, OSError) as exc:
                    log_event(contracts.EVENT_INFRA_RETRY, what="s3_get", error=str(exc)[:300], retry_in=delay)
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, FETCH_RETRY_MAX)
        if image is None:
            outcome = {**outcome, "status": ERROR, "error_message": THUMBNAIL_MISSING}
        else:
            image = await fit_image(image, self.options.image_size)
            state.thumbnails.append(identifier)
        state.fetching.discard(row)
        if self._shards.get(state.shard) is state:
            self._finish(state, row, outcome, image, journal, message)

    def _finish(self, state: _Shard, row: int, outcome: dict[str, Any], image: bytes | None, journal: bool,
                message: tuple[str, int] | None = None) -> None:
        sample = state.identity(row)
        sample.update({name: outcome.get(name) for name in _OUTCOME_NAMES})
        state.writer.add(sample, image)
        if journal:
            state.journal.append(row, {k: v for k, v in outcome.items() if k != "bad"})
        if message is not None:
            self._unreleased.append(message)
        state.finished.add(row)
        site = None if outcome.get("status") == SUCCESS or outcome.get("bad") else _site(sample["url"])
        state.tally.add(outcome, site)
        with self._lock:
            self._tally.add(outcome, site)
        self._complete_if_done(state)

    def _complete_if_done(self, state: _Shard) -> None:
        if not state.complete or state.fetching:
            return
        del self._shards[state.shard]
        self._completed[state.shard] = state.size
        stats = shard_stats(state.tally, state.started, time.time())
        self._disk.submit(self._publish, state, stats)

    def _publish(self, state: _Shard, stats: dict[str, Any]) -> None:
        """On the disk thread, in order with the syncs: a sync queued after it releases the
        shard's messages only once the shard is in place."""
        try:
            started = time.monotonic()
            state.journal.close()
            state.writer.publish(stats)
            state.journal.remove()
            if self._folder is not None:  # the shard is in place: its thumbnails are not read again
                self._folder.discard(state.thumbnails)
            log_event(contracts.EVENT_DATASET_SHARD, shard=state.shard, rows=state.size,
                      successes=state.tally.successes, folder=str(self.options.folder),
                      seconds=round(time.monotonic() - started, 3))
        except BaseException as exc:
            self._failure = exc
            raise

    async def _sync(self) -> None:
        """Make the finished rows durable (journals synced, queued publications done), then
        save the offsets past their messages."""
        loop = asyncio.get_running_loop()
        released, self._unreleased = self._unreleased, []
        journals = [shard.journal for shard in self._shards.values() if shard.journal.dirty]
        bulky = [shard.writer for shard in self._shards.values() if shard.writer.unsynced >= DATA_SYNC_BYTES]
        for writer in bulky:
            writer.unsynced = 0
        await loop.run_in_executor(self._disk, _sync_all, journals, bulky)
        if self._failure is not None:
            raise self._failure
        for name, offset in released:
            pending = self._pending.get(name)
            if pending is not None:
                pending.pop(offset, None)
        if self._next:  # not before the reading started: the saved offsets stay as they are
            await loop.run_in_executor(self._disk, self.save_offsets, self._safe_offsets())

    async def _watch_limits(self, limits: LimitSource, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                limit = await limits.limit_sum()
            except Exception as exc:  # noqa: BLE001 - the rate line is a report: Redis away must not stop the crawl
                log_event(contracts.EVENT_DATASET_LIMITS_UNREADABLE, error=repr(exc)[:300])
                limit = None
            self._rate.look(time.monotonic(), self._crawled, limit)
            await asyncio.sleep(LIMITS_INTERVAL)

    # --- reporting ------------------------------------------------------------------------
    def _snapshot(self) -> Progress:
        with self._lock:
            t = self._tally
            return Progress(rows_expected=self._expected_rows, outcomes=t.rows, successes=t.successes,
                            link_rot=t.link_rot, errors=t.errors)

    def _write_summary(self) -> None:
        self._rate.look(time.monotonic(), self._crawled, None)
        self._progress = self._snapshot()
        path = self.options.folder / STATS_FILE
        temporary = temporary_name(path)
        temporary.write_text(json.dumps(self.summary(), indent=2))
        fsync_path(temporary)
        publish(temporary, path)


def _sync_all(journals: list[Journal], writers: list[ShardWriter]) -> None:
    for writer in writers:
        writer.sync_data()
    for journal in journals:
        journal.sync()
