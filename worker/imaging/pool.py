"""A process pool for ``analysis.analyze``, so one worker uses every core.

The event loop only ships bytes in and results out, and drives each pool
process itself through a socket pair, with a second request queued behind
the one being worked on so that a process never waits for the loop between
images; the rest wait their turn, a backlogged source's first (``worker.imaging.turns``).
``concurrent.futures``' process pool does the same through a manager
thread and a feeder thread, whose wake-ups cost a quarter of a worker's CPU
(docs/decisions.md, "Our own process pool").

The pool process runs ``worker.imaging.pool_process``, which imports little (it starts
with every worker and again after each crash).

Bodies come in shared memory (``worker.fetching.shared_memory``): the download was
received straight into a segment, and the pool process reads it through
``/proc/{worker}/fd/{fd}``; only its path crosses the socket, not megabytes
of pickled bytes.
Where a segment cannot be read (not Linux, a locked-down ``/proc``), the
socket carries the body.

A pool process that dies (a decoder crash, the OOM killer) is replaced and
its images are tried once more in the new one, so one hostile file costs one
error, not the worker. One that does not answer within ``IMAGE_TIMEOUT``
(a decoder that never returns, a process stopped) is killed and replaced the
same way: the image it held ends as ``ImageTimeout``, the others it had queued
are tried again, so no task waits for an answer forever.
"""
from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import pickle
import socket
from collections import deque
from typing import Any
from collections.abc import Callable

from common.contracts import EVENT_IMAGE_POOL_BROKEN, EVENT_IMAGE_SHARED_MEMORY_UNAVAILABLE
from common.jsonlog import log_event
from common.statuses import Status
from worker import metrics
from worker.constants import IMAGE_PROCESS_NICENESS, IMAGE_TIMEOUT, REQUESTS_PER_PROCESS
from worker.imaging.pool_process import (FAILED, LENGTH, UNREADABLE, SegmentUnreadable, analyze_shared,
                                  serve)
from worker.imaging.analysis import Analysis, analyze
from worker.fetching.shared_memory import Body
from worker.imaging.turns import Turns, head_start

CRASHED = Status.IMAGE_WORKER_CRASHED
TIMED_OUT = Status.IMAGE_TIMEOUT


def default_pool_size() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class ImagePool:
    def __init__(self, processes: int | None = None, timeout: float = IMAGE_TIMEOUT):
        """``timeout``: seconds a request may wait for its answer, its turn behind the one queued
        ahead of it included."""
        self.processes = processes or default_pool_size()
        self._timeout = timeout
        self._processes = [PoolProcess.start() for _ in range(self.processes)]
        self._turns = Turns(self.processes * REQUESTS_PER_PROCESS)
        self._shared = True  # until a pool process cannot open a segment
        metrics.IMAGE_PROCESSES.set(self.processes)

    @property
    def shares_memory(self) -> bool:
        """Whether pool processes read bodies in segments from shared memory; False for good
        once one could not open a segment (the socket carries the bytes instead)."""
        return self._shared

    def process_ids(self) -> list[int]:
        """The pids of the pool's processes now (one that died is replaced when next used)."""
        return [pooled.process.pid for pooled in self._processes if pooled.process.pid is not None]

    async def analyze(self, body: Body | bytes, target_resolution: int) -> Analysis:
        """``analysis.analyze`` in a pool process; a ``Body`` in a segment is read from there."""
        path = body.path if isinstance(body, Body) else None
        if isinstance(body, Body) and path is not None and self._shared:
            try:
                return await self._run(body.size, analyze_shared, path, body.size, target_resolution)
            except SegmentUnreadable as exc:
                if self._shared:  # once: the socket still works, only slower
                    log_event(EVENT_IMAGE_SHARED_MEMORY_UNAVAILABLE, error=repr(exc)[:300])
                    self._shared = False
        data = body.bytes() if isinstance(body, Body) else body
        return await self._run(len(data), analyze, data, target_resolution)

    async def _run(self, size: int, function: Callable[..., Analysis], *args: Any) -> Analysis:
        request = pickle.dumps((function, args), protocol=pickle.HIGHEST_PROTOCOL)
        for attempt in (1, 2):
            async with self._turns.turn(head_start()):
                process = min(self._processes, key=lambda candidate: candidate.queued)
                try:
                    with metrics.IMAGE_POOL.busy(process):
                        async with asyncio.timeout(self._timeout):
                            outcome, value = await process.call(request)
                except ProcessDied:
                    log_event(EVENT_IMAGE_POOL_BROKEN, attempt=attempt, size=size)
                    self._replace(process)
                    continue
                except TimeoutError:  # its stream is out of step for good: the others it held go again
                    log_event(EVENT_IMAGE_POOL_BROKEN, attempt=attempt, size=size, timed_out=self._timeout)
                    self._replace(process)
                    return Analysis(error=TIMED_OUT)
            if outcome == UNREADABLE:
                raise SegmentUnreadable(value)
            if outcome == FAILED:
                raise RuntimeError(f"image process: {value}")
            return value
        return Analysis(error=CRASHED)

    def _replace(self, process: PoolProcess) -> None:
        if process in self._processes:  # the first of its callers to notice
            self._processes[self._processes.index(process)] = PoolProcess.start()
            process.kill()

    def close(self) -> None:
        for process in self._processes:
            process.close()


class ProcessDied(Exception):
    """The pool process exited with images in hand (a decoder crash, the OOM killer)."""


# Most answers (a thumbnail and a few fields) fit in one read of this size. A larger read
# buffer costs more than it saves: 1 MiB per read made each answer cost ~3x the CPU to take in,
# as every read allocated (and paged in) a fresh megabyte.
_RECEIVE_SIZE = 256 << 10


class PoolProcess:
    """One image process and the socket pair the event loop drives it through.

    Requests are the length-prefixed pickle of ``(function, args)``, answered in
    the same order and the same way. A caller that is cancelled leaves its answer
    to arrive and be dropped: the stream stays in step.
    """

    def __init__(self, process: multiprocessing.process.BaseProcess, sock: socket.socket):
        self.process = process
        self.sock = sock
        self._answers: deque[asyncio.Future] = deque()  # one per request sent, in order
        self._received = bytearray()
        self._sending = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def start(cls) -> PoolProcess:
        # spawn: forking a process that runs Kafka and event-loop threads is unsafe, and a
        # spawned child's parent is this process, so it can be told to die with it.
        ours, theirs = socket.socketpair()
        process = multiprocessing.get_context("spawn").Process(
            target=serve, args=(theirs, os.getpid()), name="image-process", daemon=True)
        try:
            process.start()
        finally:
            theirs.close()
        # Lower its priority at once rather than from inside it: its imports already count.
        niceness = min(os.getpriority(os.PRIO_PROCESS, 0) + IMAGE_PROCESS_NICENESS, 19)
        assert process.pid is not None  # started above
        with contextlib.suppress(OSError):  # it died already: the first call will say so
            os.setpriority(os.PRIO_PROCESS, process.pid, niceness)
        ours.setblocking(False)
        return cls(process, ours)

    @property
    def queued(self) -> int:
        return len(self._answers)

    async def call(self, request: bytes) -> tuple[str, Any]:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self.sock, self._on_readable)
        answer = self._loop.create_future()
        async with self._sending:
            if self.sock.fileno() < 0:
                raise ProcessDied("the image process is gone")
            self._answers.append(answer)
            try:
                await self._loop.sock_sendall(self.sock, LENGTH.pack(len(request)) + request)
            except BaseException as exc:
                # Cancelled or refused mid-request: the stream is out of step for good.
                self._fail(ProcessDied(repr(exc)))
                if isinstance(exc, OSError):
                    raise ProcessDied(repr(exc)) from exc
                raise
        return await answer

    def _on_readable(self) -> None:
        data: bytes | bytearray
        try:
            data = self.sock.recv(_RECEIVE_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._fail(ProcessDied("the image process closed its socket"))
            return
        if self._received:  # the rest of an answer that came in pieces
            self._received += data
            data = self._received
        # Answers are unpickled straight from what was received: no copy of each answer first.
        start = 0
        with memoryview(data) as view:
            while len(data) - start >= LENGTH.size:
                (length,) = LENGTH.unpack_from(data, start)
                end = start + LENGTH.size + length
                if len(data) < end:
                    break
                answer = self._answers.popleft()
                if not answer.done():  # a cancelled caller's answer is dropped
                    answer.set_result(pickle.loads(view[start + LENGTH.size:end]))
                start = end
        if data is self._received:  # answers taken from the front: the rest stays where it is
            del self._received[:start]
        else:
            self._received = bytearray(data[start:])

    def _fail(self, error: Exception) -> None:
        if self._loop is not None and self.sock.fileno() >= 0:
            self._loop.remove_reader(self.sock)
        self.sock.close()
        while self._answers:
            answer = self._answers.popleft()
            if not answer.done():
                answer.set_exception(error)

    def kill(self) -> None:
        """For a process that died, or whose stream broke."""
        self._fail(ProcessDied("killed"))
        self.process.kill()
        self.process.join()

    def close(self, timeout: float = 1.0) -> None:
        """Closing the socket ends the process's loop; one still busy after ``timeout`` is killed."""
        self._fail(ProcessDied("the pool is closed"))
        self.process.join(timeout)
        if self.process.is_alive():
            self.kill()
