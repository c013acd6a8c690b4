"""The worker's loop: each URL read from ``urls`` starts on a slot, waits in its source's lane, or is parked.

One consumer reads the ``urls`` topic, subscribed once: a new source costs no
rebalance. Messages wait in their source's lane (``worker.scheduling.lanes``) and
start as tasks on the source's reserved slots (its need: pace x observed latency, at
most the URLs it holds here) or, one at a time, on the shared slots that are the floor
of every source (``slots.reserve``), within MAX_TASKS. Sources are taken in rotation,
so shared slots go round. A task holds its slot while its image waits for the pool, where a
source's queue here, in seconds at its pace, is its images' head start (``worker.imaging.turns``).

Many sources share a partition, so no source may hold it: a URL its source
cannot take now is parked in Kafka and committed, never held here. A source
whose queue is full (seconds of what it drains at, ``sizing``), that is slow, paused
or backed off, has its next URLs parked in a wait topic until their turn
(``worker.parking.wait_topics``); a temporarily halted source's wait a turn; a halted
source's go to ``urls_halted`` until it resumes (``worker.parking.hand_back_on_resume``).
What the worker holds is bounded by MAX_QUEUED_URLS: near it the partitions that feed no fast
source are paused; past it the worker reads on but takes only the URLs of fast sources, which
need URLs every few seconds, and leaves the others in Kafka, uncommitted, to read them again once
half has gone (``worker.intake.read_ahead.ReadAhead``).

Offsets are committed per partition up to the lowest unfinished message,
and a task (or a park) finishes only after its outcome is acknowledged, so a
crash re-delivers rather than loses (at-least-once).
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from common.cancel import cancel_and_wait
from common.contracts import (EVENT_TASK_CRASHED, EVENT_WORKER_DRAINING, EVENT_WORKER_PARTITIONS,
                              EVENT_WORKER_REFRESH_FAILED, EVENT_WORKER_SUBSCRIBED, HALTED_URLS_TOPIC, URLS_TOPIC,
                              CrawlRequest, InvalidMessage, parse_crawl_request)
from common.jsonlog import log_event
from common.protocols import AsyncRedis, MessageProducer
from worker import metrics
from worker.constants import (COMMIT_INTERVAL, CONCURRENCY_HEADROOM, FAST_SOURCE_RATE, FINISHED_FLUSH_INTERVAL,
                              FORGET_ABOVE, LATENCY_SMOOTHING, MIN_TASKS_PER_SOURCE, NEW_SOURCE_REFRESH,
                              OFFER_INTERVAL, POLL_BATCH, POLL_TIMEOUT, REALLOCATE_INTERVAL, REFRESH_INTERVAL)
from worker.fetching.tokens import ShuttingDown, SourceHalted, TokenBuckets
from worker.imaging.turns import HEAD_START
from worker.intake.feed import TP, Feed, Record
from worker.intake.finished_offsets import FinishedRecord, Skips, take_new
from worker.intake.offsets import PartitionOffsets, commit_finished, committable_positions
from worker.intake.read_ahead import ReadAhead
from worker.monitor_view import MonitorView
from worker.parking.hand_over import hand_on, reject
from worker.parking.wait_topics import ahead_of_turn, next_turn, parked_message, wait_message
from worker.scheduling import sizing
from worker.scheduling.lanes import Job, Lane, Lanes, starters
from worker.scheduling.slots import need, reserve
from worker.scheduling.slow_starts import Admission

Handle = Callable[[CrawlRequest], Awaitable[float]]


@dataclass(frozen=True)
class Running:
    """What runs here at one instant, as counts (``Scheduler.running``)."""
    tasks: int                   # every task: crawls, parks, rejections
    on_slots: int                # crawls holding a slot
    by_source: dict[str, int]    # source -> its crawls, for the sources with any
    by_partition: dict[TP, int]  # partition -> its crawls, for the partitions with any


class Scheduler:
    def __init__(self, feed: Feed, redis: AsyncRedis, handle: Handle, producer: MessageProducer, tokens: TokenBuckets,
                 view: MonitorView, max_tasks: int, shutdown_timeout: float, max_queued: int = 10_000,
                 clock: Callable[[], float] = time.time, admission: Admission | None = None):
        """``admission``: the slow sources' starts while short of CPU (one of its own by default)."""
        self._feed = feed
        self._redis = redis
        self._handle = handle
        self._producer = producer
        self._tokens = tokens
        self._view = view  # what the monitor decided; refreshed here, read by the tokens and the halted line too
        self._max_tasks = max_tasks
        self._shutdown_timeout = shutdown_timeout
        self._max_queued = max_queued
        self._clock = clock  # wall clock: a parked URL's not_before is read by other workers

        self._stopping = asyncio.Event()
        self._lanes = Lanes()                      # every source known here, one lane each
        self._first_place = 0                      # which of the few candidates goes first in _dispatch: in turn
        self._slow_demand = 0.0                    # the slow sources' summed paces
        self._admission = admission or Admission()
        self._queued = 0                           # jobs in all the queues
        self._total = 0                            # tasks running on a slot
        self._parking = 0                          # parks not yet acknowledged
        self._tasks: set[asyncio.Task] = set()
        self._crawling: dict[TP, set[asyncio.Future]] = {}  # partition -> its crawls running here
        self._offsets: dict[TP, PartitionOffsets] = {}
        self._assigned: set[TP] = set()
        self._paused: set[TP] = set()              # partitions paused: MAX_QUEUED_URLS (nearly) reached
        self._finished = FinishedRecord(redis)     # offsets finished above the commits, for the next owner
        self._skips = Skips()                      # offsets a previous owner finished: not read again
        # Past MAX_QUEUED_URLS: only fast sources' URLs taken, the others left in Kafka and read again.
        self._read_ahead = ReadAhead(max_queued, view, self._lanes, self._pace, self._queue_limit)
        self._new_work = False                     # a source was queued here since the last refresh
        self._next_refresh = 0.0
        self._last_refresh = 0.0
        self._next_commit = 0.0
        self._next_offer = 0.0
        self._next_flush = 0.0
        self._next_reallocate = 0.0

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        await self._feed.subscribe([URLS_TOPIC])
        log_event(EVENT_WORKER_SUBSCRIBED, topics=[URLS_TOPIC])
        probe = asyncio.ensure_future(self._admission.probe_forever())
        try:
            while not self._stopping.is_set():
                await self._refresh_if_due()
                self._admission.update(bool(self._lanes.fast), self._slow_demand)
                batch = await self._feed.poll(POLL_BATCH, POLL_TIMEOUT)
                await self._rebalanced(batch.assigned, batch.revoked, batch.rebalance)
                for record in batch.records:
                    self._accept(record)
                await self._read_ahead.look_up_if_due(self._redis)
                self._reallocate_if_due()
                self._dispatch()
                await self._bound_reading()
                await self._commit_if_due()
        finally:
            await cancel_and_wait({probe})
            await self._drain()

    def held(self) -> int:
        """URLs held here, queued or being parked: what MAX_QUEUED_URLS bounds."""
        return self._queued + self._parking

    def running(self) -> Running:
        """The tasks running here, read-only: a slot taken is a crawl counted in each of them."""
        return Running(tasks=len(self._tasks), on_slots=self._total,
                       by_source={source: lane.running for source, lane in self._lanes.running.items()},
                       by_partition={tp: len(crawls) for tp, crawls in self._crawling.items()})

    def load(self) -> metrics.SchedulerLoad:
        """Tasks waiting and running, and slots, by slot class: for the worker's /metrics."""
        reserved = sum(lane.reserved for lane in self._lanes.reserved.values())
        on_reserved = sum(min(lane.running, lane.reserved) for lane in self._lanes.running.values())
        return metrics.SchedulerLoad(
            waiting=self._queued,
            in_flight={metrics.RESERVED: on_reserved, metrics.SHARED: self._total - on_reserved},
            slots={metrics.RESERVED: reserved, metrics.SHARED: self._max_tasks - reserved})

    # --- what the monitor decided, through Redis ---------------------------------
    async def _refresh_if_due(self) -> None:
        now_mono = time.monotonic()
        # New sources' rates are read soon: until then their queue is QUEUE_UNRATED long.
        new_source_due = self._new_work and now_mono >= self._last_refresh + NEW_SOURCE_REFRESH
        if now_mono < self._next_refresh and not new_source_due:
            return
        counted = self._last_refresh > 0.0 and now_mono > self._last_refresh
        fresh: list[str] = []
        flagged: list[Lane] = []
        for lane in self._lanes:  # one pass over every lane
            lane.measure(now_mono - self._last_refresh, now_mono, counted)  # what it drained at since the last refresh
            if lane.new or lane.parked_lately:
                flagged.append(lane)
            # The limits of the sources new here or parked lately (not of every source each time),
            # and of those whose queues wait for theirs to be trimmed (_queue_limit).
            if lane.parked_lately or (lane.new and lane.working) or self._unjudged_long(lane):
                fresh.append(lane.source)
        fresh.sort()
        self._last_refresh = now_mono
        self._next_refresh = now_mono + REFRESH_INTERVAL
        working = self._lanes.working()
        # A paused source (rate 0) may have no work here, its URLs all parked, but its rate decides
        # how they are taken when they come back: read on, so that the pause's end is seen.
        names = sorted(working.keys() | self._view.paused())
        for lane in flagged:
            lane.parked_lately = False  # those parked from now on are read at the next refresh
        try:
            await self._view.refresh(self._redis, names, fresh)
        except Exception as exc:  # noqa: BLE001 - Redis away (any client error): keep the last known state
            log_event(EVENT_WORKER_REFRESH_FAILED, error=repr(exc)[:300])
            return
        self._new_work = False
        for lane in flagged:
            lane.new = False
        if self._view.sources_known() > 2 * len(working) + FORGET_ABOVE:  # a worker meets millions of sources
            self._view.forget(keep=working)
            self._lanes.forget_idle(self._clock())
        stopped = self._view.stopped
        for source, lane in list(self._lanes.waiting.items()):
            if source in stopped:  # its queue goes to wait: the slots go to the others
                jobs, lane.queue = lane.queue, []
                del self._lanes.waiting[source]
                self._queued -= len(jobs)
                for job in jobs:
                    self._park(job, lane)
        for lane in list(self._lanes.waiting.values()):
            self._trim(lane)

    def _trim(self, lane: Lane) -> None:
        """Park what a queue holds beyond twice its limit: URLs queued before the source's rate
        was known (QUEUE_UNRATED), or before it was backed off, would hold its partition's
        commit for as long as they take at its rate."""
        queue, limit = lane.queue, self._queue_limit(lane)
        if len(queue) > 2 * limit:
            extra = [queue.pop() for _ in range(len(queue) - limit)]
            self._queued -= len(extra)
            for job in reversed(extra):
                self._park(job, lane)

    # --- partitions and messages ----------------------------------------------
    async def _rebalanced(self, assigned: list[TP], revoked: list[TP], timing: dict[str, float]) -> None:
        revoked_set = set(revoked)
        cancelled = 0
        if revoked:
            await self._finished.flush()  # what finished here, for the next owner
            self._skips.forget(revoked)
            self._read_ahead.forget(revoked)  # uncommitted: the next owner reads them from the commit
        for tp in revoked:
            # Another worker owns it now (or this one again, from its commit): forget its queued
            # URLs, and stop its crawls, which could not be committed. A request already sent is
            # sent again by the next owner either way.
            self._assigned.discard(tp)
            self._offsets.pop(tp, None)
            for task in self._crawling.pop(tp, set()):
                cancelled += task.cancel()
        if revoked_set:
            for source, lane in list(self._lanes.waiting.items()):
                kept = [job for job in lane.queue if job.tp not in revoked_set]
                self._queued -= len(lane.queue) - len(kept)
                lane.queue = kept
                if not kept:
                    del self._lanes.waiting[source]
        self._assigned.update(assigned)
        self._paused -= revoked_set
        # Before any of their records is taken: what a previous owner finished above the commit.
        loaded = await self._finished.load(assigned)
        self._skips.add(loaded)
        if assigned and self._paused and not self._read_ahead.past_bound:
            await self._feed.pause(assigned)  # the feed starts them unpaused
            self._paused.update(assigned)
        if assigned or revoked:
            log_event(EVENT_WORKER_PARTITIONS, assigned=len(assigned), revoked=len(revoked),
                      now_owned=len(self._assigned), crawls_stopped=cancelled,
                      finished_skipped=sum(len(o) for o in loaded.values()), **timing)

    def _accept(self, record: Record) -> None:
        tp, held = (record.topic, record.partition), self.held()
        read_ahead = self._read_ahead
        read_ahead.read(tp, record.offset, held)  # past the bound from this record on, not a batch later
        offsets = self._offsets.get(tp)
        if offsets is not None and offsets.seen(record.offset):
            # Read again after a rewind: new only if it was left past the bound.
            if not read_ahead.takes_again(record, tp, held):
                return
            offsets.add(record.offset)
            offsets.held_back = read_ahead.first_left(tp)
        elif not read_ahead.takes(record, tp, held):
            self._leave(record)
            return
        elif not take_new(record, self._offsets, self._skips):
            return
        try:
            request = parse_crawl_request(record.value)
        except InvalidMessage as exc:
            self._spawn(Job(tp, record.offset, None), None, self._reject(record, str(exc)))
            return
        job = Job(tp, record.offset, request)
        lane = self._lanes.lane(request.source)
        if lane.fast:
            lane.fed(tp)
        view = self._view
        if lane.source in view.halted or lane.source in view.temp_halted or (
                lane.queue and len(lane.queue) >= self._queue_limit(lane)):
            self._park(job, lane)
            return
        if not lane.queue:
            self._lanes.waiting[lane.source] = lane
            lane.new = self._new_work = True
        lane.queue.append(job)
        self._queued += 1

    def _leave(self, record: Record) -> None:
        """Left in Kafka, past the bound: not held, not committed; read again after the rewind."""
        tp = (record.topic, record.partition)
        offsets = self._offsets.get(tp)
        if offsets is None:
            offsets = self._offsets[tp] = PartitionOffsets()
            self._skips.first_read(tp, record.offset)
        offsets.passed(record.offset)
        if self._skips.take(tp, record.offset):  # a previous owner finished it
            return
        self._read_ahead.leave(tp, record.offset)
        offsets.held_back = self._read_ahead.first_left(tp)

    async def _reject(self, record: Record, error: str) -> float:
        await reject(self._producer, record, error)
        return 0.0

    def _park(self, job: Job, lane: Lane) -> None:
        """Send the URL to wait in Kafka; its offset finishes once the broker has it: a halted
        source's in ``urls_halted`` for its resume, the others' in a wait topic for their turn."""
        assert job.request is not None
        source = lane.source
        if source in self._view.halted:
            topic, value = HALTED_URLS_TOPIC, parked_message(job.request, job.tp[1])
            metrics.parked(metrics.PARKED_TO_HALTED)
        else:
            now = self._clock()
            # Spaced by what its queue drains at; while it slow-starts, by its limit (its grant is
            # about to climb there).
            pace = self._pace(source)
            rate = pace if self._view.slow_start_limit(source) is not None else self._drain_rate(lane)
            lane.parked_lately = True
            view = self._view
            not_before, latest = next_turn(now, rate, pace, len(lane.queue), lane.last_turn,
                                           rate_known=view.rate(source) is not None, judged=view.judged(source),
                                           temp_halted=source in view.temp_halted)
            if latest:  # the next one is placed after its turn; it is written to come back ahead of it
                lane.last_turn = not_before
                not_before = ahead_of_turn(not_before, now)
            topic, value = wait_message(job.request, not_before, now, job.tp[1])
            metrics.parked(metrics.PARKED_TO_WAIT)
        self._parking += 1
        self._spawn(job, None, self._send_parked(topic, value, job.request))

    async def _send_parked(self, topic: str, value: bytes, request: CrawlRequest) -> float:
        try:
            await hand_on(self._producer, request, topic, value)
        finally:
            self._parking -= 1
        return 0.0

    # --- slots and starts ------------------------------------------------------
    def _reallocate_if_due(self) -> None:
        """A pass over every working source, at most every REALLOCATE_INTERVAL rather than at each
        round of the loop (docs/decisions.md, "Fleet scale")."""
        now = time.monotonic()
        if now >= self._next_reallocate:
            self._next_reallocate = now + REALLOCATE_INTERVAL
            self._reallocate()

    def _reallocate(self) -> None:
        needs: dict[str, float] = {}
        fast: dict[str, Lane] = {}
        slow_demand = 0.0
        working = self._lanes.working()
        for source, lane in working.items():  # one pass: 10,000 sources at 100,000
            pace = self._pace(source)
            held = len(lane.queue) + lane.running
            if held > MIN_TASKS_PER_SOURCE:  # one holding no more than its floor is never reserved
                needs[source] = need(pace, lane.latency, held, CONCURRENCY_HEADROOM)
            if pace >= FAST_SOURCE_RATE:
                fast[source] = lane
            else:
                slow_demand += pace
        for lane in self._lanes.reserved.values():
            lane.reserved = 0
        reserved = reserve(needs, self._max_tasks, MIN_TASKS_PER_SOURCE, sources=len(working))
        for source, slots in reserved.items():
            working[source].reserved = slots
        for source, lane in self._lanes.fast.items():
            if source not in fast:
                lane.fast = False
                lane.fed_from = frozenset()
        for lane in fast.values():
            lane.fast = True
        self._lanes.reserved = {source: working[source] for source in reserved}
        self._lanes.fast, self._slow_demand = fast, slow_demand

    def _dispatch(self) -> None:
        """Start what the slots and the slow sources' allowance (``worker.scheduling.slow_starts``) allow,
        one task per source per round, sources in rotation.

        Called whenever a task ends, so it is kept cheap: after the first round
        only the sources that started one go round again, since nothing that
        stopped a source (its slots, the shared ones, the allowance) loosens meanwhile.
        """
        if self._stopping.is_set():
            return
        lanes = self._lanes
        waiting, reserved, fast = lanes.waiting, lanes.reserved, lanes.fast
        admission = self._admission
        shared_free = (self._max_tasks - sum(lane.reserved for lane in reserved.values())
                       - sum(lane.running - lane.reserved for lane in lanes.running.values()
                             if lane.running > lane.reserved))
        slow_open = admission.may_start_slow()
        candidates, self._first_place = starters(lanes, shared_free, slow_open, self._first_place)
        while candidates and self._total < self._max_tasks:
            started: list[Lane] = []
            closed = False  # the allowance ran out in this round
            for lane in candidates:
                if self._total >= self._max_tasks:
                    return
                on_shared = lane.running >= lane.reserved  # beyond its reservation: the floor, shared
                if on_shared and (lane.running >= MIN_TASKS_PER_SOURCE or shared_free <= 0):
                    continue
                if not lane.fast:
                    if not slow_open:
                        continue
                    admission.started_slow()
                    slow_open = admission.may_start_slow()
                    closed = not slow_open
                if on_shared:
                    shared_free -= 1
                del waiting[lane.source]  # re-inserted last: the rotation
                job = lane.queue.pop(0)
                self._queued -= 1
                if lane.queue:
                    waiting[lane.source] = lane
                else:
                    lane.ran_dry = True
                assert job.request is not None  # a message to reject never waits in a queue
                self._spawn(job, lane, self._crawl(lane, job.request))
                if lane.queue:
                    started.append(lane)
                if closed:  # the rest of this round: the fast sources only
                    started += [f for s, f in fast.items() if s in waiting and f not in started]
                    break
            candidates = started

    async def _crawl(self, lane: Lane, request: CrawlRequest) -> float:
        HEAD_START.set(functools.partial(self._head_start, lane))  # this task's context only
        busy = await self._handle(request)
        lane.ended += 1
        self._admission.ended()
        lane.latency = sizing.smoothed(lane.latency, max(busy, 0.0), LATENCY_SMOOTHING)
        return busy

    def _spawn(self, job: Job, lane: Lane | None, work: Awaitable[float]) -> None:
        """``lane``: the source whose slot the task takes; None for a park or a rejection."""
        if lane is not None:
            lane.running += 1
            self._lanes.running[lane.source] = lane
            self._total += 1
        task = asyncio.ensure_future(self._finish_after(job, lane, work))
        self._tasks.add(task)
        if lane is not None:
            self._crawling.setdefault(job.tp, set()).add(task)
        task.add_done_callback(functools.partial(self._task_done, job, lane, work))

    async def _finish_after(self, job: Job, lane: Lane | None, work: Awaitable[float]) -> None:
        try:
            await work
            offsets = self._offsets.get(job.tp)
            if offsets is not None:
                offsets.finish(job.offset)
                self._finished.finished(job.tp, job.offset)
        except (SourceHalted, ShuttingDown):
            # Halted, or stopping (_drain), while waiting for a token: nothing was sent; the URL
            # waits in Kafka for its turn.
            if job.tp in self._offsets and lane is not None:
                self._park(job, lane)
        except Exception as exc:  # noqa: BLE001 - a bug: keep the offset unfinished rather than lose the URL
            log_event(EVENT_TASK_CRASHED, topic=job.tp[0], partition=job.tp[1], offset=job.offset,
                      error=repr(exc)[:500])

    def _task_done(self, job: Job, lane: Lane | None, work: Awaitable[float], task: asyncio.Future) -> None:
        """A task's slot back, however it ended: a callback, not a ``finally`` in the task, since a
        task cancelled before its first step (a revoked partition's crawl) never enters its body."""
        if inspect.iscoroutine(work):
            work.close()  # not started if cancelled first: closed, not "never awaited"
        self._tasks.discard(task)
        if lane is None:
            return
        crawling = self._crawling.get(job.tp)
        if crawling is not None:
            crawling.discard(task)
            if not crawling:
                del self._crawling[job.tp]
        lane.running -= 1
        if not lane.running:  # kept small: _dispatch sums over it at each task's end
            del self._lanes.running[lane.source]
        self._total -= 1
        self._dispatch()

    # --- flow control and commits -----------------------------------------------
    async def _bound_reading(self) -> None:
        """The bound on the worker's memory, whatever the number of sources: near and past
        MAX_QUEUED_URLS, the partitions paused and read again where ``ReadAhead.bound`` says."""
        reading = self._read_ahead.bound(self.held(), self._assigned, self._paused, self._offsets)
        if reading.paused != self._paused:
            await self._feed.pause(sorted(reading.paused - self._paused))
            await self._feed.resume(sorted(self._paused - reading.paused))
            self._paused = reading.paused
        if reading.seek:
            self._read_ahead.seeking(reading)
            await self._feed.seek(reading.seek)
        self._read_ahead.trace_if_due(self.held(), self._assigned, self._paused, self._offsets)

    async def _commit_if_due(self) -> None:
        now = time.monotonic()
        if now >= self._next_commit:
            await self._commit()
        elif now >= self._next_offer:
            self._offer_positions(now)
        if now >= self._next_flush:
            self._next_flush = now + FINISHED_FLUSH_INTERVAL
            await self._finished.flush()

    def _offer_positions(self, now: float) -> None:
        """What finished since the last commit, for the feed to commit if the partition is revoked
        before the next one (``KafkaFeed.offer_positions``); every OFFER_INTERVAL, not every round:
        each partition's position is the least of its unfinished offsets, thousands at a time."""
        self._next_offer = now + OFFER_INTERVAL
        self._feed.offer_positions(committable_positions(self._owned_offsets()))

    async def _commit(self) -> None:
        self._next_commit = time.monotonic() + COMMIT_INTERVAL
        self._finished.committed(await commit_finished(self._feed.commit, self._owned_offsets()))

    def _owned_offsets(self) -> dict[TP, PartitionOffsets]:
        """The offsets of the partitions this worker owns now: only those may be committed."""
        return {tp: offsets for tp, offsets in self._offsets.items() if tp in self._assigned}

    async def _drain(self) -> None:
        """Stop taking work; park the URLs queued here and those still waiting for a token; let
        requests in flight finish and the parks be acknowledged (bounded); commit.

        Parked, the queued URLs come back at their turn and the commit passes all that was read;
        left unfinished, each would hold its partition's commit, and the next owner would read
        again everything finished above it. What is not acknowledged in time (Kafka away) stays
        uncommitted for the next owner."""
        self._stopping.set()
        self._tokens.close()
        log_event(EVENT_WORKER_DRAINING, tasks=len(self._tasks), queued=self._queued)
        waiting, self._lanes.waiting = self._lanes.waiting, {}
        self._queued = 0
        for lane in waiting.values():
            jobs, lane.queue = lane.queue, []
            for job in jobs:
                self._park(job, lane)
        deadline = time.monotonic() + self._shutdown_timeout
        while self._tasks and deadline > time.monotonic():  # and the parks started meanwhile
            await asyncio.wait(set(self._tasks), timeout=deadline - time.monotonic())
        await cancel_and_wait(set(self._tasks))
        await self._commit()
        await self._finished.flush()

    # --- sizing, from the lane's facts and the monitor's decisions ---------------
    def _head_start(self, lane: Lane) -> float:
        return sizing.head_start(len(lane.queue), self._pace(lane.source))

    def _pace(self, source: str) -> float:
        return sizing.pace(self._view.rate(source), self._view.slow_start_limit(source))

    def _drain_rate(self, lane: Lane) -> float:
        return sizing.drain_rate(self._pace(lane.source), lane.throughput, lane.running, lane.latency)

    def _queue_limit(self, lane: Lane) -> int:
        known = self._view.rate(lane.source) is not None and self._view.judged(lane.source)
        return sizing.queue_limit(known, self._drain_rate(lane), lane.reserved)

    def _unjudged_long(self, lane: Lane) -> bool:
        """Not judged yet, with a queue long enough to be trimmed once it is: its adaptive state is
        read again at each refresh until the monitor has saved it."""
        return len(lane.queue) > 4 * MIN_TASKS_PER_SOURCE and not self._view.judged(lane.source)

