"""The halted line: URLs of halted sources wait in ``urls_halted`` and come back on resume.

A halted source's URLs are no outcome (SPEC.md §1), and they may not wait in
``urls`` either: they would hold back every other source of their partitions.
So the scheduler parks them here, and this line, one more consumer
in each worker, reads the topic only when it may have something to hand back:
when a source leaves ``halted`` (and every few seconds for a while after, for
the URLs that other workers, which see the resume up to a refresh later, park
meanwhile), when it is given partitions, and every HALTED_RESCAN_SECONDS. A
scan writes a marker at the end of each partition and reads up to it: URLs of
sources no longer halted go back to ``urls``; the others are written again at
the end of the topic, for the next scan. Each
record is committed only once it is handed back or written again, so a crash
repeats a hand-over, never loses one. Between scans the partitions are paused:
a halt of days costs nothing, and a resume costs one read of what waits here.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from typing import Protocol

from common.contracts import HALTED_URLS_TOPIC, SCAN_MARKER_FIELD, URLS_TOPIC
from common.protocols import MessageProducer
from worker.constants import (HALTED_RESCAN_SECONDS, HALTED_RESUME_GRACE_SECONDS, HALTED_RESUME_RESCAN_SECONDS,
                              POLL_BATCH, WAIT_POLL_SECONDS)
from worker.intake.feed import TP, Feed, Record
from worker.outcomes.task import deliver
from worker.monitor_view import MonitorView
from worker.parking.hand_over import hand_on, parse_or_reject
from worker.parking.wait_topics import decoded, hand_back


class HaltedFeed(Feed, Protocol):
    async def seek(self, positions: dict[TP, int]) -> None: ...


def scan_marker() -> bytes:
    """The value a scan writes at the end of each partition it reads: where the scan stops."""
    return json.dumps({SCAN_MARKER_FIELD: uuid.uuid4().hex}).encode()


_MARKER_PREFIX = json.dumps({SCAN_MARKER_FIELD: ""}).encode()[:-4]  # b'{"halted_scan":'


def is_scan_marker(value: bytes | None) -> bool:
    return (value or b"").startswith(_MARKER_PREFIX)


class HaltedLine:
    def __init__(self, feed: HaltedFeed, producer: MessageProducer, view: MonitorView,
                 url_partitions: int = 1, clock: Callable[[], float] = time.monotonic):
        """``view``: the monitor's decisions, as the scheduler last read them: which sources are halted."""
        self._feed = feed
        self._producer = producer
        self._view = view
        self._url_partitions = url_partitions
        self._clock = clock
        self._owned: set[TP] = set()
        self._scanning: set[TP] = set()  # partitions whose scan has not reached its marker
        self._marker = b""
        self._scan_started = 0.0
        self._handed_in_scan = 0
        self._seen_halted: frozenset[str] = frozenset()
        self._resumed_at = float("-inf")
        self._next_scan = 0.0
        self._stopping = asyncio.Event()
        self.parked_again = 0   # URLs written again for the next scan

    @property
    def scanning(self) -> bool:
        """A scan is under way: some partition's read has not reached its marker yet."""
        return bool(self._scanning)

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        await self._feed.subscribe([HALTED_URLS_TOPIC])
        while not self._stopping.is_set():
            batch = await self._feed.poll(POLL_BATCH, WAIT_POLL_SECONDS)
            for tp in batch.revoked:
                self._owned.discard(tp)
                self._scanning.discard(tp)
            if batch.assigned:
                self._owned.update(batch.assigned)
                await self._feed.pause(batch.assigned)  # read only within a scan
                self._next_scan = 0.0  # a new owner does not know what waits there
            halted = self._view.halted
            if self._seen_halted - halted:  # a source resumed
                self._next_scan = 0.0
                self._resumed_at = self._clock()
            self._seen_halted = halted
            await self._scan(batch.records, halted)
            if self._scanning and self._clock() > self._scan_started + HALTED_RESCAN_SECONDS:
                await self._end_scan(self._scanning, {})  # a marker that never came: start again
            if not self._scanning and self._owned and self._clock() >= self._next_scan:
                await self._start_scan()

    async def _start_scan(self) -> None:
        """Write a marker at the end of each partition and read up to it.

        The broker's reported log end cannot bound a scan: tansu reports the first offset of
        a partition's last batch, so a last batch of parked URLs would stay unread.
        """
        self._next_scan = self._clock() + HALTED_RESCAN_SECONDS
        self._scan_started = self._clock()
        self._marker = scan_marker()
        parts = sorted(self._owned)
        written = await asyncio.gather(*(deliver(self._producer, HALTED_URLS_TOPIC, self._marker, None, partition)
                                         for _, partition in parts))
        self._scanning = {tp for tp, ok in zip(parts, written, strict=True) if ok}
        self._handed_in_scan = 0
        await self._feed.resume(sorted(self._scanning))

    async def _scan(self, records: list[Record], halted: frozenset[str]) -> None:
        """Place the records read before each partition's marker; end the scans that reached it.

        A record past the marker was written after the scan began (by this line, or by a
        scheduler parking a URL): its partition is sought back to it and paused, so the
        next scan starts there; so is a record read from a partition not being scanned
        (read before its pause took effect).
        """
        placed: list[Record] = []
        positions: dict[TP, int] = {}
        ends: dict[TP, int] = {}  # partitions whose marker came -> the offset after it
        stray: dict[TP, int] = {}
        for r in records:
            tp = (r.topic, r.partition)
            if tp not in self._scanning or tp in ends:
                if tp in self._owned and tp not in ends:
                    stray[tp] = min(stray.get(tp, r.offset), r.offset)
                continue
            positions[tp] = r.offset + 1
            if r.value == self._marker:
                ends[tp] = r.offset + 1
            elif not is_scan_marker(r.value):  # an earlier scan's (or owner's) marker is passed over
                placed.append(r)
        if stray:
            await self._feed.seek(stray)
        await asyncio.gather(*(self._place(record, halted) for record in placed))
        if positions:
            await self._feed.commit(positions)
        if ends:
            await self._end_scan(set(ends), ends)

    async def _end_scan(self, parts: set[TP], seek_to: dict[TP, int]) -> None:
        await self._feed.pause(sorted(parts))
        await self._feed.seek(seek_to)
        self._scanning -= parts
        if self._scanning:
            return
        if self._handed_in_scan:
            # Another round at once: a URL of a source that resumed may have been parked here
            # while this one ran (by a worker that had not seen the resume yet).
            self._next_scan = 0.0
        elif self._clock() < self._resumed_at + HALTED_RESUME_GRACE_SECONDS:
            # Other workers see a resume up to a refresh later, and park its URLs here meanwhile,
            # after this line's scan may have ended: scans go on for a while after a resume.
            self._next_scan = min(self._next_scan, self._clock() + HALTED_RESUME_RESCAN_SECONDS)

    async def _place(self, record: Record, halted: frozenset[str]) -> None:
        message = decoded(record.value)
        request = await parse_or_reject(self._producer, record, message)
        if request is None:
            return
        value, place = record.value or b"", {}
        if request.source in halted:
            topic = HALTED_URLS_TOPIC
            self.parked_again += 1
        else:
            topic, value, place = URLS_TOPIC, request.to_json(), hand_back(message, self._url_partitions)
            self._handed_in_scan += 1
        await hand_on(self._producer, request, topic, value, place.get("partition"))
