"""Memory that a download is received into and a pool process reads from.

A body is received straight from the socket into a ``Segment``: an anonymous
shared-memory file (``memfd``) that the image process opens through
``/proc/{worker}/fd/{fd}``. The event loop never copies a body: two copies
of a 12 MP photo cost more than the rest of the worker's work on it
(docs/decisions.md, "Our own HTTP client").

A segment is mapped at the size cap but backed only as far as bytes have
arrived, a ``SEGMENT_STEP`` at a time: a hostile server announcing 50 MB and
then trickling holds the memory it sent, not what it announced. The backing
is reserved with ``posix_fallocate``, so running out of memory raises here
instead of killing the worker with SIGBUS on a write into the mapping.
Segments are reused: a fresh one pays page faults and zeroing on every page.
The memfds have no name, so nothing outlives the worker, however it dies.
Without ``memfd`` (not Linux) a segment is anonymous memory whose bytes go to
the pool through its socket.
"""
from __future__ import annotations

import asyncio
import mmap
import os
import weakref
from collections.abc import Callable

from worker.constants import IDLE_SEGMENT_BYTES, SEGMENT_STEP


class SegmentUnavailable(Exception):
    """No memory (or file descriptor) for a body: the worker's trouble, not the site's."""


class Segment:
    def __init__(self, span: int):
        self.span = span  # the most bytes it can hold
        self.fd: int | None = None
        self._close_fd = None
        try:
            if hasattr(os, "memfd_create"):
                self.fd = os.memfd_create("image-download", os.MFD_CLOEXEC)
                self._close_fd = weakref.finalize(self, os.close, self.fd)  # even if never closed
                os.ftruncate(self.fd, span)  # sparse: nothing is backed yet
                self.memory = mmap.mmap(self.fd, span)
                self.backed = 0
            else:
                self.memory = mmap.mmap(-1, span)
                self.backed = span  # anonymous memory is backed page by page by the kernel
        except OSError as exc:
            if self._close_fd is not None:
                self._close_fd()
            raise SegmentUnavailable(repr(exc)) from None
        self._view = memoryview(self.memory)
        self.on_backed: Callable[[int], None] | None = None  # told of each step backed (SegmentPool)

    @property
    def path(self) -> str | None:
        """Where a pool process opens it; None when its bytes must be sent."""
        return None if self.fd is None else f"/proc/{os.getpid()}/fd/{self.fd}"

    def window(self, offset: int) -> memoryview:
        """Backed room from ``offset`` on: at least one byte unless the segment is full."""
        while offset >= self.backed and self.backed < self.span:
            assert self.fd is not None  # without memfd the whole span is backed from the start
            size = min(SEGMENT_STEP, self.span - self.backed)
            try:
                os.posix_fallocate(self.fd, self.backed, size)
            except OSError as exc:
                raise SegmentUnavailable(repr(exc)) from None
            self.backed += size
            if self.on_backed is not None:
                self.on_backed(size)
        return self._view[offset:self.backed]

    def close(self) -> None:
        try:
            self._view.release()
            self.memory.close()
        except BufferError:  # a window is still held somewhere: the garbage collector unmaps it
            pass
        if self._close_fd is not None:
            self._close_fd()  # once: a finalizer runs at most once
            self.fd = None


class Body:
    """A downloaded body: ``size`` bytes at the start of a segment (or plain bytes)."""

    def __init__(self, size: int = 0, segment: Segment | None = None,
                 segments: SegmentPool | None = None, data: bytes | None = None):
        self.size = size
        self.segment = segment
        self._segments = segments
        self._data = data

    @classmethod
    def of(cls, data: bytes) -> Body:
        return cls(len(data), data=data)

    @property
    def path(self) -> str | None:
        return self.segment.path if self.segment is not None else None

    def bytes(self) -> bytes:
        """A copy, for the paths that cannot share the segment."""
        if self._data is not None:
            return self._data
        return self.segment.memory[:self.size] if self.segment is not None else b""

    def release(self) -> None:
        """Gives the segment back for the next download; safe to call twice."""
        segment, self.segment = self.segment, None
        if segment is not None and self._segments is not None:
            self._segments.give_back(segment)
        elif segment is not None:
            segment.close()


class SegmentPool:
    """Idle segments kept for reuse, up to ``IDLE_SEGMENT_BYTES`` of backed memory; and the
    memory the segments in use hold, for the worker's byte budget (``wait_for_room``).

    That memory is a running total, told of each step a segment backs, not a sum over the
    segments in use at each download (hundreds in hand).
    A segment dropped without being given back leaves the total when it is collected."""

    def __init__(self, span: int):
        self.span = span
        self._idle: list[Segment] = []
        self._idle_bytes = 0
        self._held = 0
        # segment -> (its bytes counted in _held, the finalizer that uncounts it if dropped unreturned)
        self._in_use: weakref.WeakKeyDictionary[Segment, tuple[list[int], weakref.finalize]] = \
            weakref.WeakKeyDictionary()
        self._returned = asyncio.Event()

    def take(self) -> Segment:
        if self._idle:
            segment = self._idle.pop()
            self._idle_bytes -= segment.backed
        else:
            segment = Segment(self.span)
        counted = [segment.backed]
        self._held += segment.backed

        def backed(size: int) -> None:
            counted[0] += size
            self._held += size
        segment.on_backed = backed
        self._in_use[segment] = (counted, weakref.finalize(segment, self._uncount, counted))
        return segment

    def _uncount(self, counted: list[int]) -> None:
        self._held -= counted[0]
        counted[0] = 0
        self._returned.set()

    @property
    def idle_count(self) -> int:
        """Segments given back and kept for reuse."""
        return len(self._idle)

    @property
    def held_bytes(self) -> int:
        """Memory backing the bodies being received or waiting for the image pool."""
        return self._held

    async def wait_for_room(self, budget: int) -> None:
        """Until the bodies in hand hold less than ``budget`` bytes: a worker whose image
        pool falls behind stops downloading instead of piling up bodies."""
        while self.held_bytes >= budget:
            self._returned.clear()
            await self._returned.wait()

    def give_back(self, segment: Segment) -> None:
        entry = self._in_use.pop(segment, None)
        if entry is not None:
            counted, finalizer = entry
            finalizer.detach()
            self._uncount(counted)
        segment.on_backed = None
        self._returned.set()
        if self._idle_bytes + segment.backed <= IDLE_SEGMENT_BYTES:
            self._idle.append(segment)
            self._idle_bytes += segment.backed
        else:
            segment.close()

    def close(self) -> None:
        for segment in self._idle:
            segment.close()
        self._idle.clear()
        self._idle_bytes = 0
