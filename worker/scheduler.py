"""Which URLs a worker crawls next, and when their offsets are committed.

One consumer reads every ``urls.{source}`` topic; messages wait in a
per-source queue and start as tasks on the source's reserved slots (its
need, rate x observed latency) or, one at a time, on the shared slots that
are the floor of every source (``allocation.reserve``), within MAX_TASKS.
A source whose queue is full (seconds of its rate), or that is halted
(``halted``/``temp_halted``), has its partitions paused: its URLs stay in
Kafka instead of piling up here. Sources are taken in rotation, so shared
slots go round.

Offsets are committed per partition up to the lowest unfinished message,
and a task finishes only after its outcome is acknowledged, so a crash
re-delivers rather than loses (at-least-once).
"""
from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from collections.abc import Awaitable, Callable

from common.contracts import (EVENT_TASK_CRASHED, EVENT_WORKER_DRAINING, EVENT_WORKER_PARTITIONS,
                              EVENT_WORKER_REFRESH_FAILED, EVENT_WORKER_SUBSCRIBE_FAILED, EVENT_WORKER_SUBSCRIBED)
from common.contracts import (REJECTED_TOPIC, CrawlRequest, InvalidMessage, parse_crawl_request,
                              rate_limit_key, rejected_message, source_of_topic, source_topic)
from common.cancel import cancel_and_wait
from common.jsonlog import log_event
from common.source_sets import read_source_sets
from common.redis_values import non_negative
from common.protocols import AsyncRedis, MessageProducer
from worker.allocation import reserve
from worker.constants import (COMMIT_INTERVAL, CONCURRENCY_HEADROOM, DEFAULT_LATENCY,
                              IDLE_REFRESH_INTERVAL, LATENCY_SMOOTHING, MIN_TASKS_PER_SOURCE,
                              POLL_BATCH, POLL_TIMEOUT, QUEUE_MAX_PER_SOURCE, QUEUE_SECONDS,
                              REFRESH_INTERVAL, SUBSCRIBE_INTERVAL, SUBSCRIBE_MAX_WAIT, SUBSCRIBE_SETTLE)
from worker.feed import TP, Feed, Record
from worker.offsets import PartitionOffsets
from worker.task import deliver
from worker.tokens import ShuttingDown, SourceHalted, TokenBuckets

Handle = Callable[[CrawlRequest], Awaitable[float]]


@dataclass(frozen=True)
class Job:
    tp: TP
    offset: int
    request: CrawlRequest | None  # None: a message to reject


class Scheduler:
    def __init__(self, feed: Feed, redis: AsyncRedis, handle: Handle, producer: MessageProducer, tokens: TokenBuckets,
                 rates: dict[str, float], max_tasks: int, shutdown_timeout: float):
        self._feed = feed
        self._redis = redis
        self._handle = handle
        self._producer = producer
        self._tokens = tokens
        self.rates = rates  # shared with TokenBuckets, which paces its polls by them
        self._max_tasks = max_tasks
        self._shutdown_timeout = shutdown_timeout

        self._stopping = asyncio.Event()
        self._sources: set[str] = set()
        self._halted: set[str] = set()
        self._latency: dict[str, float] = {}
        self._reserved: dict[str, int] = {}
        self._pending: dict[str, deque[Job]] = {}  # insertion order is the rotation order
        self._inflight: dict[str, int] = defaultdict(int)  # only sources with a task running
        self._total = 0
        self._tasks: set[asyncio.Task] = set()
        self._offsets: dict[TP, PartitionOffsets] = {}
        self._paused: set[TP] = set()
        self._assigned: dict[TP, str] = {}  # owned partition -> its source (parsed once)
        self._partitions_of: dict[str, set[TP]] = defaultdict(set)  # the same, by source
        # Sources whose queue or halt changed since the pauses were last updated: only their
        # partitions are looked at (issue 20: 10,000 partitions a poll was most of a poll's time).
        self._flow_changed: set[str] = set()
        self._next_refresh = 0.0
        self._next_subscribe = 0.0
        self._unsubscribed = 0          # sources seen but not yet subscribed to
        self._first_unsubscribed = 0.0  # monotonic time the first of them was seen
        self._last_unsubscribed = 0.0   # ... and the latest
        self._next_commit = 0.0

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        try:
            while not self._stopping.is_set():
                await self._refresh_if_due()
                batch = await self._feed.poll(POLL_BATCH, POLL_TIMEOUT)
                self._rebalanced(batch.assigned, batch.revoked, batch.rebalance)
                for record in batch.records:
                    self._accept(record)
                self._reallocate()
                self._dispatch()
                await self._update_pauses()
                if time.monotonic() >= self._next_commit:
                    await self._commit()
        finally:
            await self._drain()

    # --- sources, halts and rates from Redis ----------------------------------
    async def _refresh_if_due(self) -> None:
        if time.monotonic() < self._next_refresh:
            return
        # Until there is a source, one cheap read 4 times a second: joining the consumer
        # group takes seconds of its own, so every second spent not knowing adds to startup.
        self._next_refresh = time.monotonic() + (REFRESH_INTERVAL if self._sources else IDLE_REFRESH_INTERVAL)
        try:
            sets = await read_source_sets(self._redis)
            names = sorted(sets.inbound)
            rates = await self._redis.mget([rate_limit_key(s) for s in names]) if names else []
        except Exception as exc:  # noqa: BLE001 - Redis away (any client error): keep the last known state
            log_event(EVENT_WORKER_REFRESH_FAILED, error=repr(exc)[:300])
            return
        self._flow_changed |= self._halted ^ set(sets.stopped)
        self._halted = set(sets.stopped)
        self._tokens.halt(self._halted)
        # A rate or a source missing from Redis (restarted empty, say) keeps its last known
        # value: forgetting the rate would stop the pacing, forgetting the source its topic.
        parsed = {source: _as_rate(raw) for source, raw in zip(names, rates, strict=True)}
        self.rates.update({source: rate for source, rate in parsed.items() if rate is not None})
        named = set(names)
        if self._subscription_due(named):
            known = self._sources | named
            # The change revokes every partition (an eager rebalance): what finished is
            # committed first, so only the URLs in flight are read again.
            await self._commit()
            try:
                await self._feed.subscribe([source_topic(s) for s in sorted(known)])
            except Exception as exc:  # noqa: BLE001 - e.g. a name Kafka rejects: retried at the next refresh
                log_event(EVENT_WORKER_SUBSCRIBE_FAILED, error=repr(exc)[:300])
                return
            self._sources = known
            self._next_subscribe = time.monotonic() + SUBSCRIBE_INTERVAL
            self._unsubscribed = 0
            log_event(EVENT_WORKER_SUBSCRIBED, sources=len(known))

    def _subscription_due(self, names: set[str]) -> bool:
        """Whether to subscribe to the new sources among ``names`` now.

        The first sources at once; then new ones together, once none has appeared for
        SUBSCRIBE_SETTLE (or SUBSCRIBE_MAX_WAIT after the first), and at most once per
        SUBSCRIBE_INTERVAL: each change is a rebalance of the whole group, and sources that
        trickle in would make one every refresh (issue 20).
        """
        new = len(names - self._sources)
        now = time.monotonic()
        if not new:
            self._unsubscribed = 0
            return False
        if not self._sources:
            return True
        if not self._unsubscribed:
            self._first_unsubscribed = now
        if new != self._unsubscribed:
            self._unsubscribed, self._last_unsubscribed = new, now
        settled = (now - self._last_unsubscribed >= SUBSCRIBE_SETTLE
                   or now - self._first_unsubscribed >= SUBSCRIBE_MAX_WAIT)
        return settled and now >= self._next_subscribe

    # --- partitions and messages ----------------------------------------------
    def _rebalanced(self, assigned: list[TP], revoked: list[TP], timing: dict[str, float]) -> None:
        for tp in revoked:
            # Another worker owns it now: forget its queue; running tasks finish uncommitted.
            source = self._assigned.pop(tp, None) or source_of_topic(tp[0])
            self._partitions_of[source].discard(tp)
            if not self._partitions_of[source]:
                del self._partitions_of[source]
            self._paused.discard(tp)
            self._offsets.pop(tp, None)
            if source in self._pending:
                kept = deque(job for job in self._pending[source] if job.tp != tp)
                self._set_pending(source, kept)
        for tp in assigned:
            source = self._assigned[tp] = source_of_topic(tp[0])
            self._partitions_of[source].add(tp)
            self._flow_changed.add(source)
            self._paused.discard(tp)
        if assigned or revoked:
            log_event(EVENT_WORKER_PARTITIONS, assigned=len(assigned), revoked=len(revoked),
                      now_owned=len(self._assigned), **timing)

    def _accept(self, record: Record) -> None:
        tp = (record.topic, record.partition)
        offsets = self._offsets.setdefault(tp, PartitionOffsets())
        if record.offset in offsets:
            return  # re-delivered while still in progress here
        offsets.add(record.offset)
        try:
            request = parse_crawl_request(record.value)
        except InvalidMessage as exc:
            self._spawn(Job(tp, record.offset, None), None, self._reject(record, str(exc)))
            return
        source = source_of_topic(record.topic)
        self._pending.setdefault(source, deque()).append(Job(tp, record.offset, request))
        self._flow_changed.add(source)

    async def _reject(self, record: Record, error: str) -> float:
        message = rejected_message(record.topic, record.value, error)
        await deliver(self._producer, REJECTED_TOPIC, message, from_topic=record.topic, offset=record.offset)
        return 0.0

    # --- concurrency ----------------------------------------------------------
    def _reallocate(self) -> None:
        active = (set(self._pending) | set(self._inflight)) - self._halted
        needs = {s: self.rates.get(s, 0.0) * self._latency.get(s, DEFAULT_LATENCY) * CONCURRENCY_HEADROOM
                 for s in active}
        reserved = reserve(needs, self._max_tasks, MIN_TASKS_PER_SOURCE)
        self._flow_changed.update(s for s in reserved.keys() | self._reserved.keys()
                                  if reserved.get(s) != self._reserved.get(s))
        self._reserved = reserved

    def _dispatch(self) -> None:
        """Start what the slots allow, one task per source per round, sources in rotation.

        Called whenever a task ends, so it is kept cheap: after the first round
        only the sources that started one go round again, since nothing that
        stopped a source (its slots, the shared ones, a halt) loosens meanwhile.
        """
        if self._stopping.is_set():
            return
        reserved = self._reserved
        inflight = self._inflight
        shared_free = (self._max_tasks - sum(reserved.values())
                       - sum(n - reserved.get(s, 0) for s, n in inflight.items() if n > reserved.get(s, 0)))
        candidates = list(self._pending)
        while candidates and self._total < self._max_tasks:
            started = []
            for source in candidates:
                if self._total >= self._max_tasks:
                    return
                running = inflight.get(source, 0)
                if source in self._halted:
                    continue
                if running >= reserved.get(source, 0):  # beyond its reservation: the floor, shared
                    if running >= MIN_TASKS_PER_SOURCE or shared_free <= 0:
                        continue
                    shared_free -= 1
                queue = self._pending.pop(source)  # re-inserted last: the rotation
                job = queue.popleft()
                self._set_pending(source, queue)
                assert job.request is not None  # a message to reject never waits in a queue
                self._spawn(job, source, self._crawl(source, job.request))
                if queue:
                    started.append(source)
            candidates = started

    async def _crawl(self, source: str, request: CrawlRequest) -> float:
        busy = await self._handle(request)
        previous = self._latency.get(source, DEFAULT_LATENCY)
        self._latency[source] = previous + LATENCY_SMOOTHING * (max(busy, 0.0) - previous)
        return busy

    def _spawn(self, job: Job, source: str | None, work: Awaitable[float]) -> None:
        if source is not None:
            self._inflight[source] += 1
            self._total += 1
        task = asyncio.ensure_future(self._finish_after(job, source, work))
        self._tasks.add(task)

    async def _finish_after(self, job: Job, source: str | None, work: Awaitable[float]) -> None:
        try:
            await work
            offsets = self._offsets.get(job.tp)
            if offsets is not None:
                offsets.finish(job.offset)
        except SourceHalted:
            # Halted while waiting for a token: give the slot back, keep the URL for later.
            if job.tp in self._offsets and source is not None:
                self._pending.setdefault(source, deque()).appendleft(job)
                self._flow_changed.add(source)
        except ShuttingDown:
            pass  # nothing sent: the message stays uncommitted for the next owner
        except Exception as exc:  # noqa: BLE001 - a bug: keep the offset unfinished rather than lose the URL
            log_event(EVENT_TASK_CRASHED, topic=job.tp[0], partition=job.tp[1], offset=job.offset,
                      error=repr(exc)[:500])
        finally:
            self._tasks.discard(asyncio.current_task())
            if source is not None:
                self._inflight[source] -= 1
                if not self._inflight[source]:  # kept small: _dispatch sums over it at each task's end
                    del self._inflight[source]
                self._total -= 1
                self._dispatch()

    def _set_pending(self, source: str, queue: deque[Job]) -> None:
        self._flow_changed.add(source)
        if queue:
            self._pending[source] = queue
        else:
            self._pending.pop(source, None)

    # --- flow control and commits -----------------------------------------------
    async def _update_pauses(self) -> None:
        to_pause, to_resume = [], []
        changed, self._flow_changed = self._flow_changed, set()
        for source in changed:
            high = self._queue_limit(source)
            queued = len(self._pending.get(source, ()))
            for tp in self._partitions_of.get(source, ()):
                if tp not in self._paused and (source in self._halted or queued >= high):
                    to_pause.append(tp)
                elif tp in self._paused and source not in self._halted and queued <= high // 2:
                    to_resume.append(tp)
        await self._feed.pause(to_pause)
        await self._feed.resume(to_resume)
        self._paused.update(to_pause)
        self._paused.difference_update(to_resume)

    def _queue_limit(self, source: str) -> int:
        """URLs of ``source`` to hold here before its partitions are paused (constants.QUEUE_SECONDS)."""
        by_slots = 2 * max(self._reserved.get(source, 0), MIN_TASKS_PER_SOURCE)
        by_rate = int(self.rates.get(source, 0.0) * QUEUE_SECONDS)
        return min(max(by_slots, by_rate), QUEUE_MAX_PER_SOURCE)

    async def _commit(self) -> None:
        self._next_commit = time.monotonic() + COMMIT_INTERVAL
        positions = {tp: position for tp, offsets in self._offsets.items()
                     if tp in self._assigned and (position := offsets.committable()) is not None}
        if positions and await self._feed.commit(positions):
            for tp, position in positions.items():
                self._offsets[tp].committed = position

    async def _drain(self) -> None:
        """Stop taking work, let requests in flight finish (bounded), commit what finished."""
        self._stopping.set()
        self._tokens.close()
        log_event(EVENT_WORKER_DRAINING, tasks=len(self._tasks))
        if self._tasks:
            _done, late = await asyncio.wait(set(self._tasks), timeout=self._shutdown_timeout)
            await cancel_and_wait(late)
        await self._commit()


def _as_rate(raw) -> float | None:
    """A usable rate from ``rate_limit:{source}``, or None (unknown: the source gets its floor)."""
    return non_negative(raw)
