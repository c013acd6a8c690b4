"""The wait line: hands waiting URLs back to ``urls`` once due (see ``worker.waiting``,
which writes them)."""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from common.contracts import (REJECTED_TOPIC, URLS_TOPIC, WAIT_TOPICS, InvalidMessage, parse_crawl_request,
                              rejected_message)
from common.protocols import MessageProducer
from worker.constants import POLL_BATCH, WAIT_POLL_SECONDS
from worker.feed import TP, Feed, Record
from worker.waiting import hand_back, wait_message, wait_times
from worker.task import persist


class WaitLine:
    def __init__(self, feed: Feed, producer: MessageProducer, url_partitions: int = 1,
                 clock: Callable[[], float] = time.time):
        self._feed = feed
        self._producer = producer
        self._url_partitions = url_partitions
        self._clock = clock
        self._held: dict[TP, deque[Record]] = {}
        self._paused: set[TP] = set()
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        await self._feed.subscribe(list(WAIT_TOPICS))
        while not self._stopping.is_set():
            batch = await self._feed.poll(POLL_BATCH, WAIT_POLL_SECONDS)
            for tp in batch.revoked:  # another worker's now: it reads them again from the commit
                self._held.pop(tp, None)
                self._paused.discard(tp)
            self._paused.difference_update(batch.assigned)
            for record in batch.records:
                self._held.setdefault((record.topic, record.partition), deque()).append(record)
            await self._hand_over_due()

    async def _hand_over_due(self) -> None:
        now = self._clock()
        due: list[Record] = []
        positions: dict[TP, int] = {}
        for tp, queue in self._held.items():
            while queue and wait_times(queue[0].value)[0] <= now:
                record = queue.popleft()
                due.append(record)
                positions[tp] = record.offset + 1
        await asyncio.gather(*(self._hand_over(record, now) for record in due))
        waiting = [tp for tp, queue in self._held.items() if queue]
        await self._feed.pause([tp for tp in waiting if tp not in self._paused])
        emptied = [tp for tp in self._paused if not self._held.get(tp)]
        await self._feed.resume(emptied)
        self._paused.update(waiting)
        self._paused.difference_update(emptied)
        if positions:
            await self._feed.commit(positions)

    async def _hand_over(self, record: Record, now: float) -> None:
        try:
            request = parse_crawl_request(record.value)
        except InvalidMessage as exc:
            message = rejected_message(record.topic, record.value, str(exc))
            await persist("kafka_send:rejected", lambda: self._producer.send(REJECTED_TOPIC, message))
            return
        not_before = wait_times(record.value)[1]
        place = hand_back(record.value, self._url_partitions)
        if not_before > now:  # another turn
            topic, value = wait_message(request, not_before, now, place.get("partition"))
            place = {}
        else:
            topic, value = URLS_TOPIC, request.to_json()
        await persist(f"kafka_send:{topic}", lambda: self._producer.send(topic, value, request.source, **place))
