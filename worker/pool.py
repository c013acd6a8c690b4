"""A process pool for ``imaging.analyze``, so one worker uses every core.

The event loop only ships bytes in and results out. Bytes go in through
reusable shared-memory segments rather than the executor's pipe: pickling a
3.5 MB photo through the pipe cost the event loop's process about 4 ms of
CPU (64 KiB writes, each waiting for the reader), a copy into a segment the
pool process already has mapped about 0.5 ms (``bench.worker_images``).
Segments live in multiprocessing's resource tracker, which unlinks them
even when the worker is SIGKILLed.

A pool process that dies (a decoder crash, the OOM killer) breaks the whole
executor in ``concurrent.futures``; the pool is then rebuilt and the image
tried once more in a fresh one, so one hostile file costs one error, not the
worker.
"""
from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import signal
import sys
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import asynccontextmanager
from multiprocessing.shared_memory import SharedMemory
from typing import AsyncIterator

from common.jsonlog import log_event
from worker.constants import (POOL_ATTACHED_SEGMENTS, SHARED_SEGMENT_MAX, SHARED_SEGMENT_STEP,
                              SHARED_SEGMENTS_PER_PROCESS)
from worker.imaging import Analysis, analyze

CRASHED = "ImageWorkerCrashed"
_PR_SET_PDEATHSIG = 1


def default_pool_size() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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
        loop = asyncio.get_running_loop()
        async with self._segments.holding(data) as segment_name:
            call = ((analyze_shared, segment_name, len(data), target_resolution) if segment_name
                    else (analyze, data, target_resolution))
            for attempt in (1, 2):
                executor = self._executor
                try:
                    return await loop.run_in_executor(executor, *call)
                except BrokenProcessPool:
                    log_event("image_pool_broken", attempt=attempt, size=len(data))
                    if self._executor is executor:  # the first task to notice rebuilds it
                        self._executor = self._new_executor()
                        executor.shutdown(wait=False)
        return Analysis(error=CRASHED)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._segments.close()


class SharedSegments:
    """A fixed number of shared-memory segments, each lent to one analysis at a time.

    A task whose analysis is cancelled gives its segment back while the pool
    process may still be reading it; the next writer then spoils only the
    cancelled task's result, which nobody reads.
    """

    def __init__(self, count: int):
        self._segments: list[SharedMemory | None] = [None] * count
        self._free: asyncio.Queue[int] = asyncio.Queue()
        for index in range(count):
            self._free.put_nowait(index)
        self._warned = False

    @asynccontextmanager
    async def holding(self, data: bytes) -> AsyncIterator[str | None]:
        """A segment holding ``data``, by name; None when it must go through the pipe."""
        if len(data) > SHARED_SEGMENT_MAX:
            yield None
            return
        index = await self._free.get()
        try:
            segment = self._fitted(index, len(data))
            if segment is not None:
                segment.buf[:len(data)] = data
            yield segment.name if segment is not None else None
        finally:
            self._free.put_nowait(index)

    def _fitted(self, index: int, size: int) -> SharedMemory | None:
        segment = self._segments[index]
        if segment is not None and segment.size >= size:
            return segment
        self._segments[index] = None
        if segment is not None:
            _discard(segment)
        capacity = max(SHARED_SEGMENT_STEP, -(-size // SHARED_SEGMENT_STEP) * SHARED_SEGMENT_STEP)
        try:
            segment = SharedMemory(create=True, size=capacity)
        except OSError as exc:
            return self._unavailable(exc, capacity)
        try:
            # Reserve the pages now: writing into a segment that a full /dev/shm (Docker's
            # default is 64 MB) cannot back kills the process with SIGBUS; this fails instead.
            os.posix_fallocate(segment._fd, 0, capacity)  # noqa: SLF001 (no public handle)
        except OSError as exc:
            _discard(segment)
            return self._unavailable(exc, capacity)
        self._segments[index] = segment
        return segment

    def _unavailable(self, exc: OSError, capacity: int) -> None:
        if not self._warned:  # once: the pipe still works, only slower
            log_event("image_shared_memory_unavailable", size=capacity, error=repr(exc)[:300])
            self._warned = True
        return None

    def close(self) -> None:
        for index, segment in enumerate(self._segments):
            if segment is not None:
                _discard(segment)
                self._segments[index] = None


def _discard(segment: SharedMemory) -> None:
    segment.close()
    segment.unlink()


# --- in the pool processes ---------------------------------------------------
_attached: OrderedDict[str, SharedMemory] = OrderedDict()


def analyze_shared(segment_name: str, size: int, target_resolution: int) -> Analysis:
    """``analyze`` on the first ``size`` bytes of a segment, kept mapped for the next call."""
    segment = _attached.get(segment_name)
    if segment is None:
        # Attaching registers the name with the parent's resource tracker, which already has
        # it: no double unlink.
        segment = _attached[segment_name] = SharedMemory(name=segment_name)
        while len(_attached) > POOL_ATTACHED_SEGMENTS:  # segments the parent resized away
            _attached.popitem(last=False)[1].close()
    _attached.move_to_end(segment_name)
    with segment.buf[:size] as view:
        data = bytes(view)
    return analyze(data, target_resolution)


def _die_with_parent(parent_pid: int) -> None:
    """Pool initializer: a SIGKILLed worker must not leave its pool running (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
