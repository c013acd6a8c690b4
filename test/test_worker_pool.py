"""The pool's shared-memory hand-off: right bytes to the right task, and a pipe when it must."""
from __future__ import annotations

import asyncio
import os

import pytest

import worker.pool as pool_module
from test.worker_fakes import image_bytes
from worker.pool import ImagePool, Segment, SharedSegments

TARGET = 64


async def test_concurrent_analyses_each_get_their_own_image_back() -> None:
    """More analyses than segments, of growing sizes (segments are replaced while in use)."""
    pool = ImagePool(processes=2)
    sizes = [(20 + 37 * i, 10 + 23 * i) for i in range(24)]
    try:
        results = await asyncio.gather(*(pool.analyze(image_bytes("PNG", size), TARGET) for size in sizes))
        assert [(r.width, r.height) for r in results] == sizes
        results = await asyncio.gather(*(pool.analyze(image_bytes("JPEG", size), TARGET)
                                         for size in reversed(sizes)))
        assert [(r.width, r.height) for r in results] == list(reversed(sizes))
        assert any(segment is not None for segment in pool._segments._segments)  # they were used
    finally:
        pool.close()


async def test_a_body_over_the_segment_cap_goes_through_the_pipe(monkeypatch) -> None:
    monkeypatch.setattr(pool_module, "SHARED_SEGMENT_MAX", 100)
    pool = ImagePool(processes=1)
    try:
        result = await pool.analyze(image_bytes("JPEG", (300, 200)), TARGET)
        assert (result.width, result.height) == (300, 200)
        assert pool._segments._segments == [None, None]  # never used
    finally:
        pool.close()


async def test_no_memory_for_a_segment_falls_back_to_the_pipe_and_says_so_once(monkeypatch, capsys) -> None:
    def no_memory(capacity: int) -> Segment:
        raise OSError(12, "Cannot allocate memory")
    monkeypatch.setattr(Segment, "create", staticmethod(no_memory))
    pool = ImagePool(processes=1)
    try:
        for size in ((40, 30), (50, 60)):
            result = await pool.analyze(image_bytes("PNG", size), TARGET)
            assert (result.width, result.height) == size
    finally:
        pool.close()
    assert capsys.readouterr().out.count("image_segment_unavailable") == 1


async def test_a_pool_process_that_cannot_read_segments_turns_them_off(monkeypatch, capsys) -> None:
    """As where /proc hides other processes: the pipe carries this image and every later one."""
    monkeypatch.setattr(Segment, "path", property(lambda self: f"/proc/{os.getpid()}/fd/999999"))
    pool = ImagePool(processes=1)
    try:
        for size in ((40, 30), (50, 60), (70, 20)):
            result = await pool.analyze(image_bytes("PNG", size), TARGET)
            assert (result.width, result.height) == size
        assert pool._segments._enabled is False
    finally:
        pool.close()
    assert capsys.readouterr().out.count("image_shared_memory_unavailable") == 1


def test_segments_are_whole_steps_and_close_their_memory() -> None:
    segments = SharedSegments(1)
    segment = segments._fitted(0, 10)
    assert segment.capacity == pool_module.SHARED_SEGMENT_STEP
    bigger = segments._fitted(0, pool_module.SHARED_SEGMENT_STEP + 1)
    assert bigger.capacity == 2 * pool_module.SHARED_SEGMENT_STEP
    assert segment.memory.closed  # the outgrown one was let go
    segments.close()
    assert bigger.memory.closed
    with pytest.raises(OSError):
        os.fstat(bigger.fd)
