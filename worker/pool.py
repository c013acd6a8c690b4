"""A process pool for ``imaging.analyze``, so one worker uses every core.

The event loop only ships bytes in and results out. A pool process that
dies (a decoder crash, the OOM killer) breaks the whole executor in
``concurrent.futures``; the pool is then rebuilt and the image tried once
more in a fresh one, so one hostile file costs one error, not the worker.
"""
from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import signal
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from common.jsonlog import log_event
from worker.imaging import Analysis, analyze

CRASHED = "ImageWorkerCrashed"
_PR_SET_PDEATHSIG = 1


def default_pool_size() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class ImagePool:
    def __init__(self, processes: int | None = None):
        self.processes = processes or default_pool_size()
        self._executor = self._new_executor()

    def _new_executor(self) -> ProcessPoolExecutor:
        # spawn: forking a process that runs Kafka and event-loop threads is unsafe, and a
        # spawned child's parent is this process, so it can be told to die with it.
        return ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                   initializer=_die_with_parent, initargs=(os.getpid(),))

    async def analyze(self, data: bytes, target_resolution: int) -> Analysis:
        loop = asyncio.get_running_loop()
        for attempt in (1, 2):
            executor = self._executor
            try:
                return await loop.run_in_executor(executor, analyze, data, target_resolution)
            except BrokenProcessPool:
                log_event("image_pool_broken", attempt=attempt, size=len(data))
                if self._executor is executor:  # the first task to notice rebuilds it
                    self._executor = self._new_executor()
                    executor.shutdown(wait=False)
        return Analysis(error=CRASHED)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def _die_with_parent(parent_pid: int) -> None:
    """Pool initializer: a SIGKILLed worker must not leave its pool running (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
