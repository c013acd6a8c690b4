"""The wait line: hands URLs waiting for robots.txt back to their source topic once due
(see ``worker.robots_wait``, which writes them)."""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable

from common.contracts import (CRAWL_ERRORS_TOPIC, REJECTED_TOPIC, ROBOTS_WAIT_TOPICS, InvalidMessage,
                              crawl_error_message, parse_crawl_request, rejected_message, source_topic)
from common.protocols import MessageProducer
from common.statuses import Status
from worker.constants import POLL_BATCH, ROBOTS_WAIT_POLL_SECONDS
from worker.feed import TP, Feed, Record
from worker.robots_wait import wait_message, wait_times
from worker.task import deliver, persist


class RobotsWaitLine:
    def __init__(self, feed: Feed, producer: MessageProducer,
                 create_topics: Callable[[], Awaitable[None]] | None = None,
                 clock: Callable[[], float] = time.time):
        """``create_topics``: makes sure the wait topics exist (retried until it succeeds)."""
        self._feed = feed
        self._producer = producer
        self._create_topics = create_topics
        self._clock = clock
        self._held: dict[TP, deque[Record]] = {}
        self._paused: set[TP] = set()
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        if self._create_topics is not None:
            await persist("kafka_create_topics", self._create_topics)
        await self._feed.subscribe(list(ROBOTS_WAIT_TOPICS))
        while not self._stopping.is_set():
            batch = await self._feed.poll(POLL_BATCH, ROBOTS_WAIT_POLL_SECONDS)
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
            await deliver(self._producer, REJECTED_TOPIC, message, from_topic=record.topic, offset=record.offset)
            return
        not_before = wait_times(record.value)[1]
        if not_before > now:
            topic, value = wait_message(request, not_before, now)
        else:
            topic, value = source_topic(request.source), request.to_json()
        if not await deliver(self._producer, topic, value, identifier=request.uuid):
            error = crawl_error_message(request, Status.MESSAGE_REFUSED, None)
            await deliver(self._producer, CRAWL_ERRORS_TOPIC, error, identifier=request.uuid)
