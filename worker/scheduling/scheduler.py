"""The worker's loop: each URL read from ``urls`` starts on a slot, waits in its source's lane, or is parked.

One consumer reads the ``urls`` topic, subscribed once: a new source costs no
rebalance. Messages wait in their source's lane (``worker.scheduling.lanes``) and
start as tasks on the source's reserved slots (its need: pace x observed latency, at
most the URLs it holds here) or, one at a time, on the shared slots that are the floor
of every source (``slots.reserve``), within MAX_TASKS. Sources are taken in rotation,
so shared slots go round.

Many sources share a partition, so no source may hold it: a URL its source
cannot take now is parked in Kafka and committed, never held here. A source
whose queue is full (seconds of what it drains at, ``sizing``), that is slow, paused
or backed off, has its next URLs parked in a wait topic until their turn
(``worker.parking.wait_topics``); a temporarily halted source's wait a turn; a halted
source's go to ``urls_halted`` until it resumes (``worker.parking.hand_back_on_resume``).
What the worker holds is bounded by MAX_QUEUED_URLS: near it the partitions that feed no fast
source are paused; past it the worker reads on but takes only the URLs of fast sources, which
need URLs every few seconds, and leaves the others in Kafka, uncommitted, to read them again once
half has gone (``worker.intake.read_ahead``).

Offsets are committed per partition up to the lowest unfinished message,
and a task (or a park) finishes only after its outcome is acknowledged, so a
crash re-delivers rather than loses (at-least-once).
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from common.cancel import cancel_and_wait
from common.contracts import (EVENT_TASK_CRASHED, EVENT_WORKER_DRAINING, EVENT_WORKER_PARTITIONS,
                              EVENT_WORKER_REFRESH_FAILED, EVENT_WORKER_SUBSCRIBED, HALTED_URLS_TOPIC, URLS_TOPIC,
                              CrawlRequest, InvalidMessage, parse_crawl_request)
from common.jsonlog import log_event
from common.protocols import AsyncRedis, MessageProducer
from worker import metrics
from worker.constants import (COMMIT_INTERVAL, CONCURRENCY_HEADROOM, FAST_LEARNED_MAX, FAST_ROOM, FAST_SOURCE_RATE,
                              FINISHED_FLUSH_INTERVAL, FORGET_ABOVE, LATENCY_SMOOTHING, LEARNED_SECONDS,
                              LOOKUP_INTERVAL, LOOKUP_MAX,
                              MIN_TASKS_PER_SOURCE, NEW_SOURCE_REFRESH, OFFER_INTERVAL, POLL_BATCH, POLL_TIMEOUT,
                              READ_AHEAD_MAX, REFRESH_INTERVAL, REREAD_SECONDS, REWIND_INTERVAL,
                              SLOW_PARTITIONS_PAUSE_AT)
from worker.fetching.tokens import ShuttingDown, SourceHalted, TokenBuckets
from worker.intake.feed import TP, Feed, Record
from worker.intake.finished_offsets import FinishedRecord, Skips, take_new
from worker.intake.offsets import PartitionOffsets, commit_finished, committable_positions
from worker.intake.read_ahead import FastMarks, LeftBehind
from worker.intake.reading_trace import (LEFT_FULL, LEFT_SLOW, LEFT_STOPPED, LEFT_UNKNOWN, SKIPPED_AGAIN, TAKEN,
                                         TAKEN_AGAIN, ReadingTrace)
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
        self._left = LeftBehind()                  # records read past the bound and left in Kafka
        self._trace = ReadingTrace()               # what was left and why, logged every few seconds
        self._past_bound = False                   # reading past MAX_QUEUED_URLS: only fast sources' URLs taken
        self._unknown: dict[str, dict[TP, int]] = {}  # sources read past the bound, rate unknown: first URL left where
        self._learned: dict[str, tuple[float, float]] = {}  # fast sources by a look-up: (pace, when)
        self._was_fast: set[str] = set()           # sources found fast past the bound: looked up again when read
        self._marks = FastMarks()                  # where fast sources' URLs were left (their queue full)
        self._rewound_at: dict[TP, float] = {}     # when a partition was last read again for them
        self._next_lookup = 0.0
        self._next_reread = 0.0                    # past the bound, when every partition is read again
        self._fast_held = 0                        # the fast sources' queued URLs, at the last bound check
        self._slow_bound = max_queued - int(max_queued * FAST_ROOM)  # the others' URLs held at most
        self._new_work = False                     # a source was queued here since the last refresh
        self._next_refresh = 0.0
        self._last_refresh = 0.0
        self._next_commit = 0.0
        self._next_offer = 0.0
        self._next_flush = 0.0

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
                await self._look_up_if_due()
                self._reallocate()
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
                jobs, lane.queue = lane.queue, deque()
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
            self._left.forget(revoked)  # uncommitted: the next owner reads them from the commit
            for tp in revoked:
                self._rewound_at.pop(tp, None)
            self._marks.forget(revoked)
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
                kept = deque(job for job in lane.queue if job.tp not in revoked_set)
                self._queued -= len(lane.queue) - len(kept)
                lane.queue = kept
                if not kept:
                    del self._lanes.waiting[source]
        self._assigned.update(assigned)
        self._paused -= revoked_set
        # Before any of their records is taken: what a previous owner finished above the commit.
        loaded = await self._finished.load(assigned)
        self._skips.add(loaded)
        if assigned and self._paused and not self._past_bound:
            await self._feed.pause(assigned)  # the feed starts them unpaused
            self._paused.update(assigned)
        if assigned or revoked:
            log_event(EVENT_WORKER_PARTITIONS, assigned=len(assigned), revoked=len(revoked),
                      now_owned=len(self._assigned), crawls_stopped=cancelled,
                      finished_skipped=sum(len(o) for o in loaded.values()), **timing)

    def _accept(self, record: Record) -> None:
        if not self._past_bound and self.held() - self._fast_held >= self._slow_bound:  # not a batch later
            self._past_bound = True
            self._next_reread = time.monotonic() + REREAD_SECONDS
        tp = (record.topic, record.partition)
        self._marks.read(tp, record.offset)
        offsets = self._offsets.get(tp)
        if offsets is not None and offsets.seen(record.offset):
            # Read again after a rewind: new only if it was left past the bound.
            if not self._left.holds(tp, record.offset):
                self._trace.note(tp, SKIPPED_AGAIN)
                if self._past_bound:
                    self._left.read_unneeded(tp)
                return
            if self._past_bound and not self._admitted(record, tp, look_up=False):
                return
            self._left.take(tp, record.offset)
            offsets.add(record.offset)
            offsets.held_back = self._left.first(tp)
        elif self._past_bound and not self._admitted(record, tp):
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
            lane.fed_from.add(tp)
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

    def _admitted(self, record: Record, tp: TP, look_up: bool = True) -> bool:
        """Past the bound, whether a URL is taken: its source is paced at FAST_SOURCE_RATE or more
        (it needs URLs every few seconds), not stopped, and its queue here not full (else the URL is
        left in Kafka, and the partition read again from what it left once the queue runs short:
        no turn round the wait topics). A source not working here (unknown, or its rate stale) is
        looked up, for its next URLs (``look_up``: on a record's first reading; on later readings
        only a source that was fast before); a message that is no crawl request is taken (to reject it).
        What it decides is traced (``worker.intake.reading_trace``)."""
        outcome, source = self._admission_past_bound(record, tp, look_up)
        if outcome in (TAKEN, LEFT_FULL):  # a fast source's: its partition reads on
            self._left.needed(tp)
        else:
            self._left.read_unneeded(tp)
        watched = source if source in self._was_fast or source in self._learned else None
        self._trace.note(tp, TAKEN_AGAIN if outcome == TAKEN and not look_up else outcome, watched)
        return outcome == TAKEN

    def _admission_past_bound(self, record: Record, tp: TP, look_up: bool) -> tuple[str, str | None]:
        if record.key:
            source = record.key.decode("utf-8", "replace")
        else:
            try:
                source = parse_crawl_request(record.value).source
            except InvalidMessage:
                return TAKEN, None
        view = self._view
        if source in view.stopped:
            return LEFT_STOPPED, source
        lane = self._lanes.get(source)
        learned = self._learned.get(source)
        if lane is not None and lane.working and view.rate(source) is not None:  # its rate read lately
            pace = self._pace(source)
        elif learned is not None and time.monotonic() < learned[1] + LEARNED_SECONDS:
            pace = learned[0]
        else:  # unknown here, or known from before it went idle here (a stale rate): looked up
            was_fast = source in self._was_fast or self._pace(source) >= FAST_SOURCE_RATE  # a stale rate: a hint
            if (look_up or was_fast) and (source in self._unknown or len(self._unknown) < LOOKUP_MAX):
                _note_first(self._unknown.setdefault(source, {}), tp, record.offset)
            return LEFT_UNKNOWN, source
        if pace < FAST_SOURCE_RATE:
            return LEFT_SLOW, source
        self._was_fast.add(source)
        if self.held() < self._max_queued:  # the fast sources' room: the bound holds for all
            if lane is None:
                return TAKEN, source
            limit = sizing.queue_limit(True, pace, lane.reserved) if learned is not None and not lane.working \
                else self._queue_limit(lane)
            if len(lane.queue) < limit:
                return TAKEN, source
        self._marks.left(tp, source, record.offset)
        return LEFT_FULL, source

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
        self._left.leave(tp, record.offset)
        offsets.held_back = self._left.first(tp)

    async def _look_up_if_due(self) -> None:
        """The rates (or limits) of the sources read past the bound and unknown here: those found
        fast have their next URLs taken."""
        now = time.monotonic()
        if not self._unknown or now < self._next_lookup:
            return
        self._next_lookup = now + LOOKUP_INTERVAL
        unknown, self._unknown = self._unknown, {}
        try:
            found = await self._view.potential(self._redis, sorted(unknown))
        except Exception as exc:  # noqa: BLE001 - Redis away: they are looked up when read again
            log_event(EVENT_WORKER_REFRESH_FAILED, error=repr(exc)[:300])
            return
        if len(self._learned) > FAST_LEARNED_MAX:
            self._learned.clear()
        if len(self._was_fast) > FAST_LEARNED_MAX:
            self._was_fast.clear()
        now = time.monotonic()
        for source, pace in found.items():
            if pace >= FAST_SOURCE_RATE:
                self._learned[source] = (pace, now)
                for tp, offset in unknown[source].items():  # left before it was known: read again by need
                    self._marks.left(tp, source, offset)
            else:
                self._learned.pop(source, None)

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
    def _reallocate(self) -> None:
        needs: dict[str, float] = {}
        fast: dict[str, Lane] = {}
        slow_demand = 0.0
        working = self._lanes.working()
        for source, lane in working.items():  # one pass: 10,000 sources at 100,000
            pace = self._pace(source)
            needs[source] = need(pace, lane.latency, len(lane.queue) + lane.running, CONCURRENCY_HEADROOM)
            if pace >= FAST_SOURCE_RATE:
                fast[source] = lane
            else:
                slow_demand += pace
        for lane in self._lanes.reserved.values():
            lane.reserved = 0
        reserved = reserve(needs, self._max_tasks, MIN_TASKS_PER_SOURCE)
        for source, slots in reserved.items():
            working[source].reserved = slots
        for source, lane in self._lanes.fast.items():
            if source not in fast:
                lane.fast = False
                lane.fed_from = set()
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
                job = lane.queue.popleft()
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
        """The bound on the worker's memory, whatever the number of sources: past MAX_QUEUED_URLS
        held here (queued or being parked) less FAST_ROOM of it (the fast sources' queues not
        counted), every partition is read on, but only the fast sources' URLs are taken, up to the
        bound itself; the others are left in Kafka (``worker.intake.read_ahead``), a partition that
        read READ_AHEAD_MAX in a row that no fast source needed is paused until it is read again.
        At half the bound the partitions are read again from what they left (and every
        REREAD_SECONDS past it; a fast source short of URLs, from the first it left).

        Short of the bound (from SLOW_PARTITIONS_PAUSE_AT of it), and until half has gone, only the
        partitions that feed a fast source are read: its URLs come back there from their wait."""
        self._fast_held = fast_held = sum(len(lane.queue) for lane in self._lanes.fast.values())
        held = self.held() - fast_held
        feeding = self._assigned.intersection(set().union(*(lane.fed_from for lane in self._lanes.fast.values())))
        past_bound = held >= self._slow_bound or (self._past_bound and held > self._max_queued // 2)
        now = time.monotonic()
        if past_bound and not self._past_bound:
            self._next_reread = now + REREAD_SECONDS
        # At half the bound; and every REREAD_SECONDS past it, for a fast source's URLs left unmarked
        # (read while it was paused, or not looked up).
        rewind = (self._past_bound and not past_bound) or (past_bound and now >= self._next_reread)
        self._past_bound = past_bound
        if rewind:
            self._next_reread = now + REREAD_SECONDS
            # The marks stay: read from its first left record, a partition may pause (READ_AHEAD_MAX)
            # before it reaches a fast source's URLs; a mark reads them again from there.
            positions = {tp: offset for tp, offset in self._left.rewind().items() if tp in self._assigned}
            why = "reread" if past_bound else "half"
            for tp in self._assigned:  # every partition reads on, a paused one with nothing left too
                self._left.needed(tp)
        elif past_bound:
            positions, why = self._read_again_for_fast_sources(), "need"
        else:
            positions = {}
        for tp, offset in positions.items():  # read again: resumed (a paused partition would deliver nothing)
            self._left.needed(tp)
            self._marks.sought(tp, offset)
        if past_bound:
            wanted = {tp for tp in self._assigned if self._left.unneeded(tp) >= READ_AHEAD_MAX}
        elif feeding and (held >= self._max_queued * SLOW_PARTITIONS_PAUSE_AT or (
                self._paused and held > self._max_queued // 2)):
            # With no fast source working here nothing pauses short of the bound: past it the
            # reading goes on for the fast sources' URLs behind the others.
            wanted = self._assigned - feeding
        else:
            wanted = set()
        if wanted != self._paused:
            await self._feed.pause(sorted(wanted - self._paused))
            await self._feed.resume(sorted(self._paused - wanted))
            self._paused = wanted
        if positions:
            self._trace.sought(why, positions)
            await self._feed.seek(positions)
        if self._trace.due() and (past_bound or len(self._left)):
            self._trace_reading(held)

    def _trace_reading(self, held: int) -> None:
        """The reading past the bound as it stands: the fast sources' lanes, and per partition what
        it left, the fast sources' first URLs left there, whether it is paused."""
        view, now = self._view, time.monotonic()
        watched = set(self._lanes.fast) | set(self._learned) | set(list(self._was_fast)[:20])
        lanes = {}
        for source in sorted(watched):
            lane = self._lanes.get(source)
            lanes[source] = {"rate": view.rate(source), "slow_start": view.slow_start_limit(source),
                             "learned": [round(v, 1) for v in self._learned[source]] if source in self._learned
                             else None}
            if lane is not None:
                lanes[source] |= {"queue": len(lane.queue), "limit": self._queue_limit(lane), "running": lane.running,
                                  "reserved": lane.reserved, "throughput": lane.throughput, "fast": lane.fast}
        partitions = {}
        for tp in sorted(self._assigned):
            left, marks, paused = self._left.count(tp), self._marks.marks(tp), tp in self._paused
            if left or marks or paused:
                offsets = self._offsets.get(tp)
                partitions[tp] = {"left": left, "unneeded": self._left.unneeded(tp),
                                  "first_left": self._left.first(tp), "marks": marks,
                                  "paused": paused, "committed": offsets.committed if offsets else None}
        self._trace.emit({"past_bound": self._past_bound, "held": self.held(), "slow_held": held,
                          "fast_held": self._fast_held, "left": len(self._left), "spans": self._left.spans(),
                          "unknown": len(self._unknown), "was_fast": len(self._was_fast), "now": round(now, 1),
                          "next_reread_in": round(self._next_reread - now, 1), "lanes": lanes}, partitions)

    def _read_again_for_fast_sources(self) -> dict[TP, int]:
        """Past the bound, the partitions where a fast source whose queue has run short (under half
        its limit) left URLs: read again from the first URL a fast source left there (its mark, not
        the slow sources' before it), at most once per REWIND_INTERVAL each. A mark moves on as the
        partition is read past it (``FastMarks``) and goes once nothing at or past it was read."""
        now = time.monotonic()
        positions: dict[TP, int] = {}
        for tp in self._marks.partitions():
            offsets = self._offsets.get(tp)
            if tp not in self._assigned or offsets is None or self._left.first(tp) is None:
                self._marks.forget([tp])
                continue
            firsts = self._marks.marks(tp)
            gone = [source for source, offset in firsts.items() if not offsets.seen(offset)]  # read past all
            if gone:
                self._marks.drop(tp, gone)
            if not firsts or now < self._rewound_at.get(tp, 0.0) + REWIND_INTERVAL:
                continue
            if any((lane := self._lanes.get(source)) is None or len(lane.queue) < self._queue_limit(lane) // 2
                   for source in firsts):
                positions[tp] = min(firsts.values())
                self._rewound_at[tp] = now
        return positions

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
            jobs, lane.queue = lane.queue, deque()
            for job in jobs:
                self._park(job, lane)
        deadline = time.monotonic() + self._shutdown_timeout
        while self._tasks and deadline > time.monotonic():  # and the parks started meanwhile
            await asyncio.wait(set(self._tasks), timeout=deadline - time.monotonic())
        await cancel_and_wait(set(self._tasks))
        await self._commit()
        await self._finished.flush()

    # --- sizing, from the lane's facts and the monitor's decisions ---------------
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


def _note_first(firsts: dict, key: object, offset: int) -> None:
    """``firsts[key]``: the lowest offset noted for it."""
    if key not in firsts or offset < firsts[key]:
        firsts[key] = offset
