"""The wait line: hands waiting URLs back to ``urls`` once due (see ``worker.parking.wait_topics``,
which writes them).

A partition of a wait topic mixes sources whose turns come in a different order
than they were written (a turn of the 30 s line ends at its URL's time when that is under 60 s away), so the line
holds up to WAIT_HELD_PER_PARTITION records of each partition and hands over
whichever is due, not only the first: a URL due later never holds back one due
sooner behind it. Each partition's commit stays at its lowest record
not yet handed over (at-least-once); a partition holding its bound is paused
until half of it has gone. What it handed over above a commit is recorded for the
partition's next owner (``worker.intake.finished_offsets``), which does not hand it over again.
"""
from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Callable
from typing import Any

from common.contracts import URLS_TOPIC, WAIT_TOPICS
from common.protocols import AsyncRedis, MessageProducer
from worker.constants import POLL_BATCH, WAIT_HELD_PER_PARTITION, WAIT_POLL_SECONDS
from worker.intake.feed import TP, Feed, Record
from worker.intake.finished_offsets import FinishedRecord, Skips, take_new
from worker.intake.offsets import PartitionOffsets, commit_finished
from worker.parking.hand_over import hand_on, parse_or_reject
from worker.parking.wait_topics import decoded, hand_back, wait_message, wait_times


class WaitLine:
    def __init__(self, feed: Feed, producer: MessageProducer, redis: AsyncRedis, url_partitions: int = 1,
                 clock: Callable[[], float] = time.time):
        self._feed = feed
        self._producer = producer
        self._finished = FinishedRecord(redis)
        self._skips = Skips()
        self._url_partitions = url_partitions
        self._clock = clock
        self._held: dict[TP, list[tuple[float, int, Record, Any]]] = {}  # heaps by (due, offset), with the JSON
        self._offsets: dict[TP, PartitionOffsets] = {}
        self._paused: set[TP] = set()
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        await self._feed.subscribe(list(WAIT_TOPICS))
        while not self._stopping.is_set():
            batch = await self._feed.poll(POLL_BATCH, WAIT_POLL_SECONDS)
            if batch.revoked:
                await self._finished.flush()
                self._skips.forget(batch.revoked)
            for tp in batch.revoked:  # another worker's now: it reads them again from the commit
                self._held.pop(tp, None)
                self._offsets.pop(tp, None)
                self._paused.discard(tp)
            self._paused.difference_update(batch.assigned)
            self._skips.add(await self._finished.load(batch.assigned))
            for record in batch.records:
                if take_new(record, self._offsets, self._skips):  # else held already, or handed over before
                    message = decoded(record.value)  # once: the wait, the request and its place read it
                    heapq.heappush(self._held.setdefault((record.topic, record.partition), []),
                                   (wait_times(message)[0], record.offset, record, message))
            await self._hand_over_due()

    async def _hand_over_due(self) -> None:
        now = self._clock()
        due: list[tuple[Record, Any]] = []
        for heap in self._held.values():
            while heap and heap[0][0] <= now:
                _, _, record, message = heapq.heappop(heap)
                due.append((record, message))
        await asyncio.gather(*(self._hand_over(record, message, now) for record, message in due))
        for record, _ in due:
            tp = (record.topic, record.partition)
            self._offsets[tp].finish(record.offset)
            self._finished.finished(tp, record.offset)
        full = [tp for tp, heap in self._held.items() if len(heap) >= WAIT_HELD_PER_PARTITION]
        await self._feed.pause([tp for tp in full if tp not in self._paused])
        self._paused.update(full)
        freed = [tp for tp in self._paused if len(self._held.get(tp, ())) <= WAIT_HELD_PER_PARTITION // 2]
        await self._feed.resume(freed)
        self._paused.difference_update(freed)
        self._finished.committed(await commit_finished(self._feed.commit, self._offsets))
        await self._finished.flush()

    async def _hand_over(self, record: Record, message: Any, now: float) -> None:
        request = await parse_or_reject(self._producer, record, message)
        if request is None:
            return
        not_before = wait_times(message)[1]
        place = hand_back(message, self._url_partitions)
        if not_before > now:  # another turn
            topic, value = wait_message(request, not_before, now, place.get("partition"))
            place = {}
        else:
            topic, value = URLS_TOPIC, request.to_json()
        await hand_on(self._producer, request, topic, value, place.get("partition"))
