"""The halted line: URLs of halted sources wait in ``urls_halted`` and come back on resume.

A halted source's URLs are no outcome (SPEC.md §1), and they may not wait in
``urls`` either: they would hold back every other source of their partitions
(issue 26). So the scheduler parks them here, and this line, one more consumer
in each worker, reads the topic only when it may have something to hand back:
when a source leaves ``halted``, when it is given partitions, and every
HALTED_RESCAN_SECONDS. A scan reads each partition up to where its log ended
when the scan began: URLs of sources no longer halted go back to ``urls``; the
others are written again at the end of the topic, for the next scan. Each
record is committed only once it is handed back or written again, so a crash
repeats a hand-over, never loses one. Between scans the partitions are paused:
a halt of days costs nothing, and a resume costs one read of what waits here.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from common.contracts import (CRAWL_ERRORS_TOPIC, HALTED_URLS_TOPIC, REJECTED_TOPIC, URLS_TOPIC, InvalidMessage,
                              crawl_error_message, parse_crawl_request, rejected_message)
from common.statuses import Status
from common.protocols import MessageProducer
from worker.constants import HALTED_RESCAN_SECONDS, POLL_BATCH, WAIT_POLL_SECONDS
from worker.feed import TP, Feed, Record
from worker.task import deliver
from worker.waiting import hand_back


class HaltedFeed(Feed, Protocol):
    async def high_watermarks(self, parts: list[TP]) -> dict[TP, int]: ...
    async def seek(self, positions: dict[TP, int]) -> None: ...
    async def positions(self, parts: list[TP]) -> dict[TP, int]: ...


class HaltedLine:
    def __init__(self, feed: HaltedFeed, producer: MessageProducer, halted: Callable[[], frozenset[str]],
                 url_partitions: int = 1, clock: Callable[[], float] = time.monotonic):
        """``halted``: the sources in ``halted`` now, as the scheduler last read them."""
        self._feed = feed
        self._producer = producer
        self._halted = halted
        self._url_partitions = url_partitions
        self._clock = clock
        self._owned: set[TP] = set()
        self._scan_ends: dict[TP, int] = {}  # partitions being scanned -> where their log ended
        self._empty_polls = 0
        self._handed_in_scan = 0
        self._seen_halted: frozenset[str] = frozenset()
        self._next_scan = 0.0
        self._stopping = asyncio.Event()
        self.parked_again = 0   # URLs written again for the next scan

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        await self._feed.subscribe([HALTED_URLS_TOPIC])
        while not self._stopping.is_set():
            batch = await self._feed.poll(POLL_BATCH, WAIT_POLL_SECONDS)
            for tp in batch.revoked:
                self._owned.discard(tp)
                self._scan_ends.pop(tp, None)
            if batch.assigned:
                self._owned.update(batch.assigned)
                await self._feed.pause(batch.assigned)  # read only within a scan
                self._next_scan = 0.0  # a new owner does not know what waits there
            halted = self._halted()
            if self._seen_halted - halted:  # a source resumed
                self._next_scan = 0.0
            self._seen_halted = halted
            await self._scan(batch.records, halted)
            if not self._scan_ends and self._owned and self._clock() >= self._next_scan:
                await self._start_scan()

    async def _start_scan(self) -> None:
        self._next_scan = self._clock() + HALTED_RESCAN_SECONDS
        ends = await self._feed.high_watermarks(sorted(self._owned))
        self._scan_ends = {tp: end for tp, end in ends.items() if end > 0}
        self._empty_polls = 0
        self._handed_in_scan = 0
        await self._feed.resume(list(self._scan_ends))

    async def _scan(self, records: list[Record], halted: frozenset[str]) -> None:
        """Place the records read before each partition's scan end; end the scans that got there.

        A record at or past its partition's end was written after the scan began (by this
        line, or by a scheduler parking a URL): the partition is sought back to it and
        paused, so the next scan starts there. A partition whose committed position was at
        its end already yields nothing: the scan ends once polls come back empty.
        """
        stray: dict[TP, int] = {}  # read before its pause took effect: read again in a scan
        for r in records:
            tp = (r.topic, r.partition)
            if tp not in self._scan_ends:
                stray[tp] = min(stray.get(tp, r.offset), r.offset)
        if stray:
            await self._feed.seek({tp: offset for tp, offset in stray.items() if tp in self._owned})
        if not self._scan_ends:
            return
        within = [r for r in records if r.offset < self._scan_ends.get((r.topic, r.partition), -1)]
        await asyncio.gather(*(self._place(record, halted) for record in within))
        positions: dict[TP, int] = {}
        for record in within:
            tp = (record.topic, record.partition)
            positions[tp] = max(positions.get(tp, 0), record.offset + 1)
        if positions:
            await self._feed.commit(positions)
        # Seek back to each finished partition's end: a record past it was consumed, not placed.
        finished = {(r.topic, r.partition): self._scan_ends[(r.topic, r.partition)] for r in records
                    if r.offset + 1 >= self._scan_ends.get((r.topic, r.partition), r.offset + 2)}
        self._empty_polls = 0 if records else self._empty_polls + 1
        quiet: set[TP] = set()
        if self._empty_polls >= 3:
            # Quiet only where the consumer stands at the end already: right after an assignment
            # the first fetch can take seconds on tansu, and a partition paused then would keep
            # its URLs until the next scan (after a SIGKILL, 126 of 2,000 waited for it).
            waiting = sorted(set(self._scan_ends) - set(finished))
            stands = await self._feed.positions(waiting) if waiting else {}
            quiet = {tp for tp in waiting if stands.get(tp, -1) >= self._scan_ends[tp]}
        if finished or quiet:
            await self._feed.pause(sorted(set(finished) | quiet))
            await self._feed.seek(finished)
            for tp in set(finished) | quiet:
                self._scan_ends.pop(tp, None)
            if not self._scan_ends and self._handed_in_scan:
                # Another round at once: an end the broker reported may lag behind its log (tansu's
                # does), and what lies past it would otherwise wait for the next trigger. A round
                # that hands nothing back ends them; it costs the still-halted URLs one more pass.
                self._next_scan = 0.0

    async def _place(self, record: Record, halted: frozenset[str]) -> None:
        try:
            request = parse_crawl_request(record.value)
        except InvalidMessage as exc:
            message = rejected_message(record.topic, record.value, str(exc))
            await deliver(self._producer, REJECTED_TOPIC, message, from_topic=record.topic, offset=record.offset)
            return
        value, place = record.value or b"", {}
        if request.source in halted:
            topic = HALTED_URLS_TOPIC
            self.parked_again += 1
        else:
            topic, value, place = URLS_TOPIC, request.to_json(), hand_back(record.value, self._url_partitions)
            self._handed_in_scan += 1
        if not await deliver(self._producer, topic, value, request.source, place.get("partition"),
                             identifier=request.uuid):
            error = crawl_error_message(request, Status.MESSAGE_REFUSED, None)
            await deliver(self._producer, CRAWL_ERRORS_TOPIC, error, identifier=request.uuid)
