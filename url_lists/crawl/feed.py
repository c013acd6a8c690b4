"""The crawl's input stage: the list read once, in order, shard by shard.

Every record of the list gets a row number (from 0, across the files in the order
given) and so its shard and img2dataset key. Each shard's rows, bad ones included,
are written as its input shard (``url_lists.dataset.inputs``) before any of them is
produced, so the collector can join each outcome back to its row (url, caption,
additional columns) without the Kafka messages carrying them. Then the shard's
accepted rows without an outcome yet are produced to ``inbound_images``, each with
its run's identifier for the row (``keys.row_identifier``), and the collector is told
to expect the shard. Sites are counted into ``list_source_sizes`` first, as the list
producer counts them, so the monitor knows each site's rate when its URLs arrive.
"""
from __future__ import annotations

import json
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
from confluent_kafka import KafkaError, Message, Producer

from common import contracts
from common.kafka import produce_waiting
from url_lists.dataset.inputs import input_shards, write_input_shard
from url_lists.dataset.keys import row_identifier, sample_key, shard_of
from url_lists.crawl.checks import Listing
from url_lists.readers import read_batches
from url_lists.rows import row_message

FLUSH_SECONDS = 5.0


class Expecting(Protocol):
    """What the feed needs of ``url_lists.dataset.collector.Collector``."""

    def expect(self, shard: int) -> None: ...

    def no_more_shards(self) -> None: ...


@dataclass
class FeedTotals:
    rows: int = 0           # records read (bad ones included)
    bad: int = 0
    accepted: int = 0
    produced: int = 0       # by this run
    already: int = 0        # accepted rows with an outcome from an earlier run
    shards: int = 0


class Stopped(Exception):
    """The stop event was set while feeding."""


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else str(value)


def _column(values: list[Any]) -> pa.Array:
    """An additional column as read; one whose cells disagree on a type is kept as JSON text."""
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        return pa.array([None if v is None else v if isinstance(v, str) else json.dumps(v, default=str)
                         for v in values], pa.string())


class ShardRows:
    """One shard's rows as they are read, to become its input table."""

    def __init__(self, shard: int, additional: tuple[str, ...]):
        self.shard = shard
        self.additional = additional
        self.columns: dict[str, list[Any]] = {name: [] for name in (
            "row", "key", "url", "caption", "status", "bad_reason", "source_file", "source_row")}
        self.extra: list[list[Any]] = [[] for _ in additional]
        self.to_send: list[tuple[int, bytes, str]] = []  # accepted, no outcome yet: (row, message, identifier)
        self.sites: Counter[str] = Counter()             # accepted rows per site
        self.end = 0                                      # one past its last row

    def add(self, row: int, key: str, url: Any, caption: Any, extra: tuple[Any, ...], bad: str | None,
            source_file: str, source_row: int) -> None:
        for name, value in (("row", row), ("key", key), ("url", _text(url)), ("caption", _text(caption)),
                            ("status", "bad" if bad else "accepted"), ("bad_reason", bad),
                            ("source_file", source_file), ("source_row", source_row)):
            self.columns[name].append(value)
        for cells, value in zip(self.extra, extra, strict=True):
            cells.append(value)

    def table(self) -> pa.Table:
        arrays = {
            "row": pa.array(self.columns["row"], pa.int64()),
            "key": pa.array(self.columns["key"], pa.string()),
            "url": pa.array(self.columns["url"], pa.string()),
            "caption": pa.array(self.columns["caption"], pa.string()),
            "status": pa.array(self.columns["status"], pa.string()),
            "bad_reason": pa.array(self.columns["bad_reason"], pa.string()),
            "source_file": pa.array(self.columns["source_file"], pa.string()),
            "source_row": pa.array(self.columns["source_row"], pa.int64()),
        }
        for name, cells in zip(self.additional, self.extra, strict=True):
            arrays[name] = _column(cells)
        return pa.table(arrays)


class Inbound:
    """Sends one shard's messages to ``inbound_images`` and waits until the broker has them all."""

    def __init__(self, producer: Producer, stop: threading.Event):
        self._producer = producer
        self._stop = stop

    def send(self, messages: list[tuple[bytes, bytes]]) -> None:
        """(key, value) pairs; a message the broker refused is sent again until it is taken."""
        failed: list[tuple[bytes, bytes]] = []

        def delivered(err: KafkaError | None, message: Message) -> None:
            if err is not None:
                failed.append((message.key() or b"", message.value() or b""))

        pending = messages
        while pending:
            for key, value in pending:
                produce_waiting(self._producer, contracts.INBOUND_TOPIC, value, key, delivered)
            while self._producer.flush(FLUSH_SECONDS) > 0:
                if self._stop.is_set():
                    raise Stopped()
            pending, failed = failed, []
            if pending and self._stop.wait(1.0):
                raise Stopped()


class Feed:
    """Reads the list, writes the input shards, produces the rows that still need an outcome."""

    def __init__(self, listing: Listing, folder: Path, per_shard: int, run: uuid.UUID,
                 inbound: Callable[[list[tuple[bytes, bytes]]], None],
                 count_sites: Callable[[Counter[str], int], None], collector: Expecting,
                 finished: set[int], stop: threading.Event):
        self._listing = listing
        self._folder = folder
        self._per_shard = per_shard
        self._run = run
        self._inbound = inbound
        self._count_sites = count_sites
        self._collector = collector
        self._finished = finished
        self._stop = stop
        self._written = set(input_shards(folder))
        self.totals = FeedTotals()

    def run(self) -> FeedTotals:
        current: ShardRows | None = None
        for row, values, bad, source_file, source_row in self._records():
            shard = shard_of(row, self._per_shard)
            if current is None or current.shard != shard:
                if current is not None:
                    self._finish(current)
                current = ShardRows(shard, self._listing.additional)
            self._add(current, row, values, bad, source_file, source_row)
        if current is not None:
            self._finish(current)
        self._collector.no_more_shards()
        return self.totals

    def _records(self) -> Iterator[tuple[int, tuple[Any, ...], str | None, str, int]]:
        """(row, values, why it is bad or None, file, its record number) of every record."""
        columns = self._listing.columns()
        width = len(columns.slots())
        row = 0
        for path, kind in zip(self._listing.files, self._listing.formats, strict=True):
            for batch in read_batches(path, kind, columns):
                if self._stop.is_set():
                    raise Stopped()
                for index, values in enumerate(batch.values):
                    error = batch.errors.get(index)
                    if values is None and error is None:
                        continue  # a blank line: no record
                    yield row, values or (None,) * width, error, batch.path, batch.first_row + index
                    row += 1

    def _add(self, shard: ShardRows, row: int, values: tuple[Any, ...], bad: str | None,
             source_file: str, source_row: int) -> None:
        url, extra = values[0], values[3:]
        caption = extra[0] if self._listing.caption_col else None
        additional = extra[1:] if self._listing.caption_col else extra
        totals = self.totals
        totals.rows += 1
        if bad is None:
            identifier = row_identifier(self._run, row)
            try:
                message, site = row_message(url, identifier, None, True, False)
            except contracts.InvalidMessage as exc:
                bad = str(exc)
            else:
                totals.accepted += 1
                shard.sites[site] += 1
                if row in self._finished:
                    totals.already += 1
                else:
                    shard.to_send.append((row, message, identifier))
        if bad is not None:
            totals.bad += 1
        shard.end = row + 1
        shard.add(row, sample_key(row, self._per_shard), url, caption, tuple(additional), bad,
                  source_file, source_row)

    def _finish(self, shard: ShardRows) -> None:
        if self._stop.is_set():
            raise Stopped()
        if shard.shard not in self._written:  # a resumed run's shard is already there, the same
            write_input_shard(self._folder, shard.shard, shard.table())
            self._written.add(shard.shard)
        self._count_sites(shard.sites, shard.end)  # before the URLs: the monitor knows each site's rate
        self._inbound([(identifier.encode(), message) for _, message, identifier in shard.to_send])
        self.totals.produced += len(shard.to_send)
        self.totals.shards += 1
        self._collector.expect(shard.shard)
