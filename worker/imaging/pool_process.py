"""The pool process's side of ``worker.imaging.pool``: its loop and what it runs.

Kept apart from ``worker.imaging.pool`` so that a spawned pool process imports only
this, ``worker.imaging.analysis`` and Pillow (~0.03 s of CPU), not the event loop's
side with its metrics and Redis client (~0.15 s): four pool processes start
with every worker pair, and one more each time a pool process dies.
"""
from __future__ import annotations

import ctypes
import pickle
import socket
import struct
from typing import Any

from common.process import die_with_parent
from worker.constants import IMAGE_PROCESS_KEPT_FREE_BYTES
from worker.imaging.analysis import Analysis, analyze

LENGTH = struct.Struct("!Q")  # the length prefix of each request and answer
DONE, UNREADABLE, FAILED = "done", "unreadable", "failed"


class SegmentUnreadable(Exception):
    """Raised in a pool process that cannot open the worker's segment: send bodies over the socket instead."""


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


def keep_freed_memory(limit: int) -> bool:
    """Have glibc's allocator keep up to ``limit`` bytes of freed memory (allocations below it
    come from the heap, which is not trimmed below it): each image's buffers then reuse the
    last image's pages. False where the C library has no ``mallopt`` (musl, macOS): the
    allocator keeps its own ways, which only costs page faults."""
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h>
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(m_mmap_threshold, limit)) and bool(mallopt(m_trim_threshold, limit))


def serve(sock: socket.socket, parent_pid: int) -> None:
    """A pool process: answer requests in order until the worker closes the socket."""
    die_with_parent(parent_pid)
    keep_freed_memory(IMAGE_PROCESS_KEPT_FREE_BYTES)
    with sock:
        while True:
            try:
                (length,) = LENGTH.unpack(_receive(sock, LENGTH.size))
                function, args = pickle.loads(_receive(sock, length))
            except EOFError:
                return
            try:
                answer: tuple[str, Any] = (DONE, function(*args))
            except SegmentUnreadable as exc:
                answer = (UNREADABLE, str(exc))
            except Exception as exc:  # noqa: BLE001 - analyze never raises for bad input: a bug
                answer = (FAILED, repr(exc)[:1000])
            reply = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
            sock.sendall(LENGTH.pack(len(reply)) + reply)


def _receive(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view, received = memoryview(buffer), 0
    while received < size:
        count = sock.recv_into(view[received:])
        if count == 0:
            raise EOFError
        received += count
    return buffer
