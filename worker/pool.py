"""A process pool for ``imaging.analyze``, so one worker uses every core.

The event loop only ships bytes in and results out. Bytes go in through
reusable anonymous shared-memory segments (``memfd``) rather than the
executor's pipe: pickling a 3.5 MB photo through the pipe cost the event
loop's process about 4 ms of CPU (64 KiB writes, each waiting for the
reader), a copy into a mapped segment about 0.5 ms (``bench.worker_images``).
A pool process reads a segment through ``/proc/{worker}/fd/{fd}``. The
segments have no name, so nothing outlives the worker, however it dies
(named ``/dev/shm`` segments leaked when a whole process group was
SIGKILLed), and ``/dev/shm``'s size (64 MB in Docker) does not apply.
Where that is not possible (not Linux, a locked-down ``/proc``), the pipe is used.

A pool process that dies (a decoder crash, the OOM killer) breaks the whole
executor in ``concurrent.futures``; the pool is then rebuilt and the image
tried once more in a fresh one, so one hostile file costs one error, not the
worker.
"""
from __future__ import annotations

import asyncio
import ctypes
import mmap
import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

from common.jsonlog import log_event
from worker.constants import SHARED_SEGMENT_MAX, SHARED_SEGMENT_STEP, SHARED_SEGMENTS_PER_PROCESS
from worker.imaging import Analysis, analyze

CRASHED = "ImageWorkerCrashed"
_PR_SET_PDEATHSIG = 1


def default_pool_size() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class SegmentUnreadable(Exception):
    """Raised in a pool process that cannot open the worker's segment: use the pipe instead."""


class ImagePool:
    def __init__(self, processes: int | None = None):
        self.processes = processes or default_pool_size()
        self._executor = self._new_executor()
        self._segments = SharedSegments(self.processes * SHARED_SEGMENTS_PER_PROCESS)

    def _new_executor(self) -> ProcessPoolExecutor:
        # spawn: forking a process that runs Kafka and event-loop threads is unsafe, and a
        # spawned child's parent is this process, so it can be told to die with it.
        return ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_die_with_parent, initargs=(os.getpid(),))

    async def analyze(self, data: bytes, target_resolution: int) -> Analysis:
        async with self._segments.holding(data) as path:
            if path is not None:
                try:
                    return await self._run(len(data), analyze_shared, path, len(data), target_resolution)
                except SegmentUnreadable as exc:
                    self._segments.disable(exc)
            return await self._run(len(data), analyze, data, target_resolution)

    async def _run(self, size: int, function, *args) -> Analysis:
        loop = asyncio.get_running_loop()
        for attempt in (1, 2):
            executor = self._executor
            try:
                return await loop.run_in_executor(executor, function, *args)
            except BrokenProcessPool:
                log_event("image_pool_broken", attempt=attempt, size=size)
                if self._executor is executor:  # the first task to notice rebuilds it
                    self._executor = self._new_executor()
                    executor.shutdown(wait=False)
        return Analysis(error=CRASHED)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._segments.close()


@dataclass
class Segment:
    fd: int
    memory: mmap.mmap
    capacity: int

    @classmethod
    def create(cls, capacity: int) -> "Segment":
        fd = os.memfd_create("image-download", os.MFD_CLOEXEC)
        try:
            # Reserve the pages now: a write into a mapping the system cannot back kills the
            # process with SIGBUS; this raises instead.
            os.posix_fallocate(fd, 0, capacity)
            return cls(fd, mmap.mmap(fd, capacity), capacity)
        except BaseException:
            os.close(fd)
            raise

    @property
    def path(self) -> str:
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def close(self) -> None:
        self.memory.close()
        os.close(self.fd)


class SharedSegments:
    """A fixed number of segments, each lent to one analysis at a time.

    A task whose analysis is cancelled gives its segment back while the pool
    process may still be reading it; the next writer then spoils only the
    cancelled task's result, which nobody reads.
    """

    def __init__(self, count: int):
        self._segments: list[Segment | None] = [None] * count
        self._free: asyncio.Queue[int] = asyncio.Queue()
        for index in range(count):
            self._free.put_nowait(index)
        self._enabled = hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")
        self._warned = False

    @asynccontextmanager
    async def holding(self, data: bytes) -> AsyncIterator[str | None]:
        """The path of a segment holding ``data``; None when it must go through the pipe."""
        if not self._enabled or len(data) > SHARED_SEGMENT_MAX:
            yield None
            return
        index = await self._free.get()
        try:
            segment = self._fitted(index, len(data))
            if segment is not None:
                segment.memory[:len(data)] = data
            yield segment.path if segment is not None else None
        finally:
            self._free.put_nowait(index)

    def _fitted(self, index: int, size: int) -> Segment | None:
        segment = self._segments[index]
        if segment is not None and segment.capacity >= size:
            return segment
        self._segments[index] = None
        if segment is not None:
            segment.close()
        capacity = max(SHARED_SEGMENT_STEP, -(-size // SHARED_SEGMENT_STEP) * SHARED_SEGMENT_STEP)
        try:
            self._segments[index] = Segment.create(capacity)
        except OSError as exc:  # no memory for it: this body goes through the pipe
            if not self._warned:
                log_event("image_segment_unavailable", size=capacity, error=repr(exc)[:300])
                self._warned = True
        return self._segments[index]

    def disable(self, exc: Exception) -> None:
        if self._enabled:  # once: the pipe still works, only slower
            log_event("image_shared_memory_unavailable", error=repr(exc)[:300])
            self._enabled = False

    def close(self) -> None:
        for index, segment in enumerate(self._segments):
            if segment is not None:
                segment.close()
                self._segments[index] = None


# --- in the pool processes ---------------------------------------------------
def analyze_shared(path: str, size: int, target_resolution: int) -> Analysis:
    """``analyze`` on the first ``size`` bytes of the worker's segment at ``path``."""
    try:
        with open(path, "rb", buffering=0) as segment:
            data = segment.read(size)
    except OSError as exc:
        raise SegmentUnreadable(repr(exc)) from None
    if len(data) != size:
        raise SegmentUnreadable(f"read {len(data)} of {size} bytes")
    return analyze(data, target_resolution)


def _die_with_parent(parent_pid: int) -> None:
    """Pool initializer: a SIGKILLed worker must not leave its pool running (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
