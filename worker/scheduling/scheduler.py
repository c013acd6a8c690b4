"""Which URLs a worker crawls next, where the others wait, and when offsets are committed.

One consumer reads the ``urls`` topic, subscribed once: a new source costs no
rebalance (issue 26). Messages wait in a per-source queue and start as tasks on
the source's reserved slots (its need: rate x observed latency, at most the
URLs it holds here) or, one at a time, on the shared slots that are the floor
of every source (``slots.reserve``), within MAX_TASKS. Sources are taken in
rotation, so shared slots go round.

Many sources share a partition, so no source may hold it: a URL its source
cannot take now is parked in Kafka and committed, never held here. A source
whose queue is full (seconds of its rate), that is slow, paused or backed off,
has its next URLs parked in a wait topic until the time its rate says they can
go (``worker.parking.wait_topics``); a temporarily halted source's wait a turn; a halted
source's go to ``urls_halted`` until it resumes (``worker.parking.hand_back_on_resume``). What
the worker holds is bounded by MAX_QUEUED_URLS: past it every partition is paused
until half has gone (those that feed a fast source only at the bound itself).

Offsets are committed per partition up to the lowest unfinished message,
and a task (or a park) finishes only after its outcome is acknowledged, so a
crash re-delivers rather than loses (at-least-once).
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from collections.abc import Awaitable, Callable

from common.contracts import (EVENT_TASK_CRASHED, EVENT_WORKER_DRAINING, EVENT_WORKER_PARTITIONS,
                              EVENT_WORKER_REFRESH_FAILED, EVENT_WORKER_SUBSCRIBED)
from common.contracts import (ADAPTIVE_CEILING_FIELD, ADAPTIVE_SLOW_START_FIELD, HALTED_URLS_TOPIC, URLS_TOPIC,
                              CrawlRequest, InvalidMessage, adaptive_key, parse_crawl_request, rate_limit_key)
from common.cancel import cancel_and_wait
from common.jsonlog import log_event
from common.source_sets import read_source_sets
from common.redis_values import non_negative
from common.protocols import AsyncRedis, MessageProducer
from worker import metrics
from worker.scheduling.slow_starts import Admission
from worker.scheduling.slots import need, reserve
from worker.constants import (COMMIT_INTERVAL, CONCURRENCY_HEADROOM, DEFAULT_LATENCY, FAST_SOURCE_RATE, FORGET_ABOVE,
                              LATENCY_SMOOTHING, MIN_TASKS_PER_SOURCE, NEW_SOURCE_REFRESH, OFFER_INTERVAL,
                              FINISHED_FLUSH_INTERVAL, PARK_DEFAULT_SECONDS, PARK_TRUST_SECONDS, PARK_UNJUDGED_SECONDS,
                              POLL_BATCH, POLL_TIMEOUT,
                              QUEUE_MAX_PER_SOURCE, QUEUE_SECONDS, QUEUE_UNRATED, REFRESH_INTERVAL,
                              SLOW_PARTITIONS_PAUSE_AT, THROUGHPUT_SMOOTHING, THROUGHPUT_WARMUP_SECONDS)
from worker.intake.feed import TP, Feed, Record
from worker.intake.finished_offsets import FinishedRecord, Skips, take_new
from worker.intake.offsets import PartitionOffsets, commit_finished, committable_positions
from worker.fetching.tokens import ShuttingDown, SourceHalted, TokenBuckets
from worker.parking.hand_over import hand_on, reject
from worker.parking.wait_topics import parked_message, wait_message

Handle = Callable[[CrawlRequest], Awaitable[float]]


@dataclass(frozen=True)
class Job:
    tp: TP
    offset: int
    request: CrawlRequest | None  # None: a message to reject


class Scheduler:
    def __init__(self, feed: Feed, redis: AsyncRedis, handle: Handle, producer: MessageProducer, tokens: TokenBuckets,
                 rates: dict[str, float], max_tasks: int, shutdown_timeout: float, max_queued: int = 10_000,
                 clock: Callable[[], float] = time.time):
        self._feed = feed
        self._redis = redis
        self._handle = handle
        self._producer = producer
        self._tokens = tokens
        self.rates = rates  # shared with TokenBuckets, which paces its polls by them
        self._max_tasks = max_tasks
        self._shutdown_timeout = shutdown_timeout
        self._max_queued = max_queued
        self._clock = clock  # wall clock: a parked URL's not_before is read by other workers

        self._stopping = asyncio.Event()
        self._crawling: dict[TP, set[asyncio.Future]] = {}  # partition -> its crawls running here
        self._first_place = 0  # which of the few candidates goes first in _dispatch: in turn
        self.halted: frozenset[str] = frozenset()       # halted: parked until resumed
        self._temp_halted: frozenset[str] = frozenset()  # temp_halted: parked for a turn
        self._latency: dict[str, float] = {}
        self._reserved: dict[str, int] = {}
        self._fast: set[str] = set()               # active sources paced at FAST_SOURCE_RATE or more
        self._slow_demand = 0.0                    # the other active sources' summed paces
        self._admission = Admission()              # the slow sources' starts while short of CPU
        self._pending: dict[str, deque[Job]] = {}  # insertion order is the rotation order
        self._queued = 0                           # jobs in all the queues
        self._inflight: dict[str, int] = defaultdict(int)  # only sources with a task running
        self._total = 0
        self._parking = 0                          # parks not yet acknowledged
        self._tasks: set[asyncio.Task] = set()
        self._offsets: dict[TP, PartitionOffsets] = {}
        self._assigned: set[TP] = set()
        self._paused: set[TP] = set()              # partitions paused: MAX_QUEUED_URLS (nearly) reached
        self._fast_parts: dict[str, set[TP]] = {}  # fast source -> the partitions its URLs came from
        self._park_at: dict[str, float] = {}       # source -> when its next parked URL may go (wall clock)
        self._limits: dict[str, float] = {}        # source -> its limit (adaptive:{source} ceiling), if parked
        self._paced: set[str] = set()              # sources whose adaptive state was read: _pace is known
        self._ended: dict[str, int] = {}           # source -> URLs ended here since the last refresh
        self._throughput: dict[str, float] = {}    # source -> URLs ended here per second, smoothed
        self._working_since: dict[str, float] = {}  # source -> when it last began to have work here
        self._working_before: set[str] = set()     # sources with work at the last refresh
        self._ran_dry: set[str] = set()            # sources whose queue emptied since the last refresh
        self._parked_lately: set[str] = set()      # sources parked since the last refresh: their limit is read
                                                   # (with the sources new here), for _pace
        self._new_work: set[str] = set()           # sources queued since the last refresh
        self._next_refresh = 0.0
        self._last_refresh = 0.0
        self._next_commit = 0.0
        self._next_offer = 0.0
        self._finished = FinishedRecord(redis)    # offsets finished above the commits, for the next owner
        self._skips = Skips()                      # offsets a previous owner finished: not read again
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
                self._admission.update(bool(self._fast), self._slow_demand)
                batch = await self._feed.poll(POLL_BATCH, POLL_TIMEOUT)
                await self._rebalanced(batch.assigned, batch.revoked, batch.rebalance)
                for record in batch.records:
                    self._accept(record)
                self._reallocate()
                self._dispatch()
                await self._bound_reading()
                now = time.monotonic()
                if now >= self._next_commit:
                    await self._commit()
                elif now >= self._next_offer:
                    self._offer_positions(now)
                if now >= self._next_flush:
                    self._next_flush = now + FINISHED_FLUSH_INTERVAL
                    await self._finished.flush()
        finally:
            await cancel_and_wait({probe})
            await self._drain()

    # --- halts, rates and demand, through Redis --------------------------------
    async def _refresh_if_due(self) -> None:
        now_mono = time.monotonic()
        # New sources' rates are read soon: until then their queue is QUEUE_UNRATED long.
        new_source_due = self._new_work and now_mono >= self._last_refresh + NEW_SOURCE_REFRESH
        if now_mono < self._next_refresh and not new_source_due:
            return
        self._measure_throughput(now_mono - self._last_refresh, now_mono)
        self._last_refresh = now_mono
        self._next_refresh = now_mono + REFRESH_INTERVAL
        working = set(self._pending) | set(self._inflight)
        # A paused source (rate 0) may have no work here, its URLs all parked, but its rate decides
        # how they are taken when they come back: read on, so that the pause's end is seen.
        names = sorted(working | {source for source, rate in self.rates.items() if rate <= 0})
        now = self._clock()
        try:
            sets = await read_source_sets(self._redis, inbound=False)
            rates = await self._redis.mget([rate_limit_key(s) for s in names]) if names else []
            # The limits of the sources new here or parked lately (not of every source each time),
            # and of those whose queues wait for theirs to be trimmed (_queue_limit).
            fresh = sorted(self._parked_lately | (self._new_work & working) | self._unjudged_long_queues())
            self._parked_lately = set()
            if fresh:
                pipe = self._redis.pipeline(transaction=False)
                for source in fresh:
                    pipe.hmget(adaptive_key(source), [ADAPTIVE_CEILING_FIELD, ADAPTIVE_SLOW_START_FIELD])
                for source, (limit, slow_start) in zip(fresh, await pipe.execute(), strict=True):
                    # Only while it slow-starts is its grant about to climb to its limit; a source
                    # backed off is crawled at its grant, and URLs parked at its limit's pace came
                    # back faster than it drained them (parked again behind all the others).
                    ceiling = _as_rate(limit)
                    if ceiling is None:  # the monitor has not judged it yet
                        self._paced.discard(source)
                    else:
                        self._paced.add(source)
                    if ceiling is not None and str(slow_start) == "1":
                        self._limits[source] = ceiling
                    else:
                        self._limits.pop(source, None)
        except Exception as exc:  # noqa: BLE001 - Redis away (any client error): keep the last known state
            log_event(EVENT_WORKER_REFRESH_FAILED, error=repr(exc)[:300])
            return
        self._new_work.clear()
        self.halted, self._temp_halted = sets.halted, sets.temp_halted
        self._tokens.halt(set(sets.stopped))
        # A rate missing from Redis (restarted empty, say) keeps its last known value:
        # forgetting it would stop the pacing. Sources with no work here are forgotten.
        parsed = {source: _as_rate(raw) for source, raw in zip(names, rates, strict=True)}
        self.rates.update({source: rate for source, rate in parsed.items() if rate is not None})
        if len(self.rates) > 2 * len(working) + FORGET_ABOVE:  # a worker meets millions of sources
            kept = {s: r for s, r in self.rates.items() if s in working}
            self.rates.clear()
            self.rates.update(kept)
            self._latency = {s: v for s, v in self._latency.items() if s in working}
            self._limits = {s: v for s, v in self._limits.items() if s in working}
            self._paced &= working
            self._throughput = {s: v for s, v in self._throughput.items() if s in working}
            self._park_at = {s: t for s, t in self._park_at.items() if t > now}
        for source in sets.stopped & working:
            if source in self._pending:  # its queue goes to wait: the slots go to the others
                jobs = self._pending.pop(source)
                self._queued -= len(jobs)
                for job in jobs:
                    self._park(job, source)
        for source in parsed.keys() & self._pending.keys():
            self._trim(source)

    def _trim(self, source: str) -> None:
        """Park what a queue holds beyond twice its limit: URLs queued before the source's rate
        was known (QUEUE_UNRATED), or before it was backed off, would hold its partition's
        commit for as long as they take at its rate."""
        queue, limit = self._pending[source], self._queue_limit(source)
        if len(queue) > 2 * limit:
            extra = [queue.pop() for _ in range(len(queue) - limit)]
            self._queued -= len(extra)
            for job in reversed(extra):
                self._park(job, source)

    # --- partitions and messages ----------------------------------------------
    async def _rebalanced(self, assigned: list[TP], revoked: list[TP], timing: dict[str, float]) -> None:
        revoked_set = set(revoked)
        cancelled = 0
        if revoked:
            await self._finished.flush()  # what finished here, for the next owner
            self._skips.forget(revoked)
        for tp in revoked:
            # Another worker owns it now (or this one again, from its commit): forget its queued
            # URLs, and stop its crawls. Left to finish, they could not be committed, and were
            # read and crawled again: 1,621 of 2,000 URLs twice after one SIGKILL's rebalance,
            # most of them tasks waiting for tokens (test_e2e_halted). A request already sent is
            # sent again by the next owner either way.
            self._assigned.discard(tp)
            self._offsets.pop(tp, None)
            for task in self._crawling.pop(tp, set()):
                cancelled += task.cancel()
        if revoked_set:
            for source in list(self._pending):
                kept = deque(job for job in self._pending[source] if job.tp not in revoked_set)
                self._queued -= len(self._pending[source]) - len(kept)
                self._set_pending(source, kept)
        self._assigned.update(assigned)
        self._paused -= revoked_set
        # Before any of their records is taken: what a previous owner finished above the commit.
        loaded = await self._finished.load(assigned)
        self._skips.add(loaded)
        if assigned and self._paused:
            await self._feed.pause(assigned)  # the feed starts them unpaused
            self._paused.update(assigned)
        if assigned or revoked:
            log_event(EVENT_WORKER_PARTITIONS, assigned=len(assigned), revoked=len(revoked),
                      now_owned=len(self._assigned), crawls_stopped=cancelled,
                      finished_skipped=sum(len(o) for o in loaded.values()), **timing)

    def _accept(self, record: Record) -> None:
        if not take_new(record, self._offsets, self._skips):
            return
        tp = (record.topic, record.partition)
        try:
            request = parse_crawl_request(record.value)
        except InvalidMessage as exc:
            self._spawn(Job(tp, record.offset, None), None, self._reject(record, str(exc)))
            return
        job = Job(tp, record.offset, request)
        source = request.source
        if source in self._fast:
            self._fast_parts.setdefault(source, set()).add(tp)
        queue = self._pending.get(source)
        if source in self.halted or source in self._temp_halted or (
                queue is not None and len(queue) >= self._queue_limit(source)):
            self._park(job, source)
            return
        if queue is None:
            queue = self._pending[source] = deque()
            self._new_work.add(source)
        queue.append(job)
        self._queued += 1

    async def _reject(self, record: Record, error: str) -> float:
        await reject(self._producer, record, error)
        return 0.0

    def _park(self, job: Job, source: str) -> None:
        """Send the URL to wait in Kafka; its offset finishes once the broker has it.

        A halted source's URLs wait in ``urls_halted`` for its resume. The others wait in a
        wait topic until their source can take them: a source's parked URLs are spaced
        1/rate apart from the end of its queue, so each comes back about when its turn
        comes (a paused, temporarily halted or unrated source's after PARK_DEFAULT_SECONDS).
        """
        assert job.request is not None
        if source in self.halted:
            topic, value = HALTED_URLS_TOPIC, parked_message(job.request, job.tp[1])
            metrics.parked(metrics.PARKED_TO_HALTED)
        else:
            now = self._clock()
            # Spaced by what its queue drains at: a source held below its pace (a site's connection
            # cap, a busy worker) had its URLs back faster than it took them, parked again and
            # again (a resumed 1,000 req/s source crawled at 160: 7,873 of 20,000 URLs crawled
            # twice after a SIGKILL). While it slow-starts, by its limit: its grant is about to climb.
            rate = self._pace(source) if source in self._limits else self._drain_rate(source)
            self._parked_lately.add(source)
            if source in self._temp_halted or (rate <= 0 and source in self.rates):  # paused: its rate is 0
                not_before = now + PARK_DEFAULT_SECONDS
            elif rate <= 0 or source not in self._paced:
                # Spaced at a new source's first grant (a tenth of its limit, before the monitor
                # has saved its state), 8,000 URLs of a 100 req/s source were parked up to 15
                # minutes ahead and came back at 10 req/s (bench.sources): they come back
                # together, soon after its state is known, and are placed by its pace then. So do
                # those read before its rate: parked for a whole turn, 7,000 of them held its
                # URLs parked later for 5 s behind them in their wait partition, and it had no
                # request from 11 to 56 s (bench.sources).
                not_before = now + PARK_UNJUDGED_SECONDS
            else:
                ahead = len(self._pending.get(source, ())) / rate
                not_before = max(self._park_at.get(source, 0.0), now + ahead) + 1.0 / rate
                if rate < self._pace(source) and not_before > now + PARK_TRUST_SECONDS:
                    # Spaced by what it achieved while 5,000 new sources took the CPU, a 100 req/s
                    # source's 9,000 URLs were placed 12 minutes ahead and came back at 12.5 req/s
                    # long after the load had gone (bench.sources): beyond one turn they come back
                    # then and are placed by what it achieves at that time.
                    not_before = now + PARK_TRUST_SECONDS
                else:
                    self._park_at[source] = not_before
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

    def load(self) -> metrics.SchedulerLoad:
        """Tasks waiting and running, and slots, by slot class: for the worker's /metrics."""
        reserved = sum(self._reserved.values())
        on_reserved = sum(min(n, self._reserved.get(s, 0)) for s, n in self._inflight.items())
        return metrics.SchedulerLoad(
            waiting=self._queued,
            in_flight={metrics.RESERVED: on_reserved, metrics.SHARED: self._total - on_reserved},
            slots={metrics.RESERVED: reserved, metrics.SHARED: self._max_tasks - reserved})

    # --- concurrency ----------------------------------------------------------
    def _reallocate(self) -> None:
        needs: dict[str, float] = {}
        fast: set[str] = set()
        slow_demand = 0.0
        for source in set(self._pending) | set(self._inflight):  # one pass: 10,000 sources at 100,000
            pace = self._pace(source)
            held = len(self._pending.get(source, ())) + self._inflight.get(source, 0)
            needs[source] = need(pace, self._latency.get(source, DEFAULT_LATENCY), held, CONCURRENCY_HEADROOM)
            if pace >= FAST_SOURCE_RATE:
                fast.add(source)
            else:
                slow_demand += pace
        self._reserved = reserve(needs, self._max_tasks, MIN_TASKS_PER_SOURCE)
        self._fast, self._slow_demand = fast, slow_demand

    def _dispatch(self) -> None:
        """Start what the slots and the slow sources' allowance (``worker.scheduling.slow_starts``) allow,
        one task per source per round, sources in rotation.

        Called whenever a task ends, so it is kept cheap: after the first round
        only the sources that started one go round again, since nothing that
        stopped a source (its slots, the shared ones, the allowance) loosens meanwhile.
        """
        if self._stopping.is_set():
            return
        reserved = self._reserved
        inflight = self._inflight
        fast = self._fast
        admission = self._admission
        shared_free = (self._max_tasks - sum(reserved.values())
                       - sum(n - reserved.get(s, 0) for s, n in inflight.items() if n > reserved.get(s, 0)))
        slow_open = admission.may_start_slow()
        # With no shared slot free only the sources with a reservation can start, and with no
        # allowance only the fast ones: at 10,000 sources queued, going round all of them at every
        # task's end was most of the loop.
        if shared_free > 0 and slow_open:
            candidates = list(self._pending)
        else:
            few = reserved.keys() if shared_free <= 0 and slow_open else (
                fast if shared_free > 0 else fast & reserved.keys())
            candidates = [s for s in few if s in self._pending]
            # Taken in the same order each time, the first sources took every slot that freed:
            # with all 500 slots running (others over the reservations they had before a
            # reallocation), a 200 req/s source with 6 reserved had none running for 6 s, its
            # URLs were parked by the 0 req/s it achieved, and it ended the crawl at 1 req/s
            # (bench.peer_img2dataset). So the first place goes round.
            if candidates:
                self._first_place = (self._first_place + 1) % len(candidates)
                candidates = candidates[self._first_place:] + candidates[:self._first_place]
        while candidates and self._total < self._max_tasks:
            started = []
            closed = False  # the allowance ran out in this round
            for source in candidates:
                if self._total >= self._max_tasks:
                    return
                running = inflight.get(source, 0)
                on_shared = running >= reserved.get(source, 0)  # beyond its reservation: the floor, shared
                if on_shared and (running >= MIN_TASKS_PER_SOURCE or shared_free <= 0):
                    continue
                if source not in fast:
                    if not slow_open:
                        continue
                    admission.started_slow()
                    slow_open = admission.may_start_slow()
                    closed = not slow_open
                if on_shared:
                    shared_free -= 1
                queue = self._pending.pop(source)  # re-inserted last: the rotation
                job = queue.popleft()
                self._queued -= 1
                self._set_pending(source, queue)
                if not queue:
                    self._ran_dry.add(source)
                assert job.request is not None  # a message to reject never waits in a queue
                self._spawn(job, source, self._crawl(source, job.request))
                if queue:
                    started.append(source)
                if closed:  # the rest of this round: the fast sources only
                    started += [s for s in fast if s in self._pending and s not in started]
                    break
            candidates = started

    async def _crawl(self, source: str, request: CrawlRequest) -> float:
        busy = await self._handle(request)
        self._ended[source] = self._ended.get(source, 0) + 1
        self._admission.ended()
        previous = self._latency.get(source, DEFAULT_LATENCY)
        self._latency[source] = previous + LATENCY_SMOOTHING * (max(busy, 0.0) - previous)
        return busy

    def _spawn(self, job: Job, source: str | None, work: Awaitable[float]) -> None:
        if source is not None:
            self._inflight[source] += 1
            self._total += 1
        task = asyncio.ensure_future(self._finish_after(job, source, work))
        self._tasks.add(task)
        if source is not None:
            self._crawling.setdefault(job.tp, set()).add(task)
        task.add_done_callback(functools.partial(self._task_done, job, source, work))

    async def _finish_after(self, job: Job, source: str | None, work: Awaitable[float]) -> None:
        try:
            await work
            offsets = self._offsets.get(job.tp)
            if offsets is not None:
                offsets.finish(job.offset)
                self._finished.finished(job.tp, job.offset)
        except (SourceHalted, ShuttingDown):
            # Halted, or stopping (_drain), while waiting for a token: nothing was sent; the URL
            # waits in Kafka for its turn.
            if job.tp in self._offsets and source is not None:
                self._park(job, source)
        except Exception as exc:  # noqa: BLE001 - a bug: keep the offset unfinished rather than lose the URL
            log_event(EVENT_TASK_CRASHED, topic=job.tp[0], partition=job.tp[1], offset=job.offset,
                      error=repr(exc)[:500])

    def _task_done(self, job: Job, source: str | None, work: Awaitable[float], task: asyncio.Future) -> None:
        """A task's slot back, however it ended: a callback, not a ``finally`` in the task, since a
        task cancelled before its first step (a revoked partition's crawl) never enters its body."""
        if inspect.iscoroutine(work):
            work.close()  # not started if cancelled first: closed, not "never awaited"
        self._tasks.discard(task)
        if source is None:
            return
        crawling = self._crawling.get(job.tp)
        if crawling is not None:
            crawling.discard(task)
            if not crawling:
                del self._crawling[job.tp]
        self._inflight[source] -= 1
        if not self._inflight[source]:  # kept small: _dispatch sums over it at each task's end
            del self._inflight[source]
        self._total -= 1
        self._dispatch()

    def _set_pending(self, source: str, queue: deque[Job]) -> None:
        if queue:
            self._pending[source] = queue
        else:
            self._pending.pop(source, None)

    # --- flow control and commits -----------------------------------------------
    async def _bound_reading(self) -> None:
        """Pause every partition while MAX_QUEUED_URLS are held here (queued or being parked),
        resume at half: the bound on the worker's memory, whatever the number of sources.

        Short of the bound (from SLOW_PARTITIONS_PAUSE_AT of it), and until half has gone, the
        partitions that feed a fast source stay open: its URLs come back there from their wait,
        and with every partition paused behind 9,000 URLs of slow sources, a 100 req/s source
        had no request for 27 s (bench.sources)."""
        held = self._queued + self._parking
        self._fast_parts = {s: parts for s, parts in self._fast_parts.items() if s in self._fast}
        feeding = self._assigned.intersection(set().union(*self._fast_parts.values()))
        if held >= self._max_queued:
            wanted = set(self._assigned)
        elif (feeding and held >= self._max_queued * SLOW_PARTITIONS_PAUSE_AT) or (
                self._paused and held > self._max_queued // 2):
            wanted = self._assigned - feeding
        else:
            wanted = set()
        if wanted != self._paused:
            await self._feed.pause(sorted(wanted - self._paused))
            await self._feed.resume(sorted(self._paused - wanted))
            self._paused = wanted

    def _measure_throughput(self, elapsed: float, now: float | None = None) -> None:
        """Each source's URLs ended here per second, smoothed, for ``_queue_limit``; not in its first
        THROUGHPUT_WARMUP_SECONDS here (its robots.txt, its first tokens). Measured over its first
        0.2 s, a 20 req/s source drained at 4: its queue was trimmed to that and the rest parked
        4 a second apart, and it ran at 4 req/s for 30 s (test_e2e_halted)."""
        now = time.monotonic() if now is None else now
        ended, self._ended = self._ended, {}
        working = set(self._pending) | set(self._inflight)
        measured, self._working_before = self._working_before & working, working
        for source in working - self._working_since.keys():
            self._working_since[source] = now
        for source in self._working_since.keys() - working:
            del self._working_since[source]
        for source in self._throughput.keys() - working:  # idle here: what it achieved is history
            del self._throughput[source]
        if self._last_refresh == 0.0 or elapsed <= 0:
            return
        dry, self._ran_dry = self._ran_dry, set()
        for source in measured:  # had work through the whole interval
            if now - self._working_since[source] < THROUGHPUT_WARMUP_SECONDS:
                continue
            if source in dry:
                # It ran out of URLs here: what it achieved says what came, not what it can do. Kept,
                # a source ramping up (its URLs parked for a turn) was held to twice its first few
                # requests a second: 0 to 45 of 100 req/s for a minute (bench.sources).
                self._throughput.pop(source, None)
                continue
            if not ended.get(source) and not self._inflight.get(source):
                continue  # none of its URLs ran here: held by this worker's slots, not by its site
            observed = ended.get(source, 0) / elapsed
            previous = self._throughput.get(source, observed)
            self._throughput[source] = previous + THROUGHPUT_SMOOTHING * (observed - previous)

    def _queue_limit(self, source: str) -> int:
        """URLs of ``source`` to queue here before the next are parked (constants.QUEUE_SECONDS of
        its pace, or of twice what it achieves here if that is less).

        A queue holds its partition's commit at its oldest URL, and everything finished above
        it (parks included) is read again after a rebalance or a crash: a 1,000 req/s source
        that a site's connection cap held to 70 req/s queued 5,000 URLs, 70 s of its work, and
        a SIGKILL then had 9,000 URLs crawled twice.
        """
        if self.rates.get(source) is None or source not in self._paced:
            # Its rate, or the monitor's first judgment of it, not read yet: no reason to park yet.
            # Parked before its judgment, a URL waits PARK_UNJUDGED_SECONDS whatever its pace: the
            # last of a 6 req/s source's 72 URLs came 5 s after the rest, 72% of its limit (CI).
            return QUEUE_UNRATED
        rate = self._drain_rate(source)
        by_slots = 2 * max(self._reserved.get(source, 0), MIN_TASKS_PER_SOURCE)
        by_rate = int(rate * QUEUE_SECONDS)
        return min(max(by_slots, by_rate), QUEUE_MAX_PER_SOURCE)

    def _unjudged_long_queues(self) -> set[str]:
        """Sources not judged yet whose queues are long enough to be trimmed once they are: their
        adaptive state is read again at each refresh until the monitor has saved it."""
        return {source for source, queue in self._pending.items()
                if len(queue) > 4 * MIN_TASKS_PER_SOURCE and source not in self._paced}

    def _drain_rate(self, source: str) -> float:
        """What a source's queue is sized by: its pace, or twice what it achieves here if that is
        less (a site's connection cap, a slow site, a busy worker): a queue holds its partition's
        commit at its oldest URL. Parked URLs are spaced by it too, except during a slow start
        (by the limit then: spaced by what a source achieved while its grant climbed, a 100
        req/s source's URLs were parked up to an hour ahead and it never got past 8% of its
        limit, bench.sources); an interval in which its queue ran dry does not count.

        Nor below twice what its tasks running now sustain (running / latency, Little's law): what
        it achieved is history, and a source measured while the others held most of the slots
        (its rate read after theirs) had its URLs parked at 5 req/s of its 200, up to 13 s
        ahead, and the crawl's last 5 s were that source alone (bench.peer_img2dataset). Held
        by its site, what it sustains is what it achieves."""
        rate = self._pace(source)
        achieved = self._throughput.get(source)
        if achieved is None:
            return rate
        sustained = self._inflight.get(source, 0) / max(self._latency.get(source, DEFAULT_LATENCY), 1e-3)
        return min(rate, max(2 * max(achieved, sustained), 1.0))

    def _pace(self, source: str) -> float:
        """The rate a source's slots, queue and parked URLs are sized by: what it is granted now,
        or, while it slow-starts, its limit. During a slow start the grant climbs from a tenth of the limit
        within seconds; URLs parked at a tenth's pace came back minutes late (the restart test:
        a 6 req/s source crawled at 1 req/s for two minutes), and those parked at the limit's
        pace come back early at worst (and are parked again: four messages). The tokens, not the
        slots, keep the site's rate."""
        return max(self.rates.get(source, 0.0), self._limits.get(source, 0.0))

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

        Left unfinished, a queued URL held its partition's commit, and whoever read the partition
        next read again everything finished above it, parks included: three workers stopped
        together twice in a crawl's first 20 s, and the sites saw 1,296 requests for 592 URLs
        (test_all_workers_stopped_together_then_one_started). Parked, they come back at their
        turn and the commit passes all that was read. What is not acknowledged in time (Kafka
        away) stays uncommitted for the next owner, as before."""
        self._stopping.set()
        self._tokens.close()
        log_event(EVENT_WORKER_DRAINING, tasks=len(self._tasks), queued=self._queued)
        pending, self._pending = self._pending, {}
        self._queued = 0
        for source, queue in pending.items():
            for job in queue:
                self._park(job, source)
        deadline = time.monotonic() + self._shutdown_timeout
        while self._tasks and deadline > time.monotonic():  # and the parks started meanwhile
            await asyncio.wait(set(self._tasks), timeout=deadline - time.monotonic())
        await cancel_and_wait(set(self._tasks))
        await self._commit()
        await self._finished.flush()


def _as_rate(raw) -> float | None:
    """A usable rate from ``rate_limit:{source}``, or None (unknown: the source gets its floor)."""
    return non_negative(raw)
