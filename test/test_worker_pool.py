"""The pool's shared-memory hand-off: right bytes to the right task, and a pipe when it must."""
from __future__ import annotations

import asyncio
from pathlib import Path

import worker.pool as pool_module
from test.worker_fakes import image_bytes
from worker.pool import ImagePool

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


async def test_no_shared_memory_falls_back_to_the_pipe_and_says_so_once(monkeypatch, capsys) -> None:
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(pool_module, "SharedMemory", full)
    pool = ImagePool(processes=1)
    try:
        for size in ((40, 30), (50, 60)):
            result = await pool.analyze(image_bytes("PNG", size), TARGET)
            assert (result.width, result.height) == size
    finally:
        pool.close()
    assert capsys.readouterr().out.count("image_shared_memory_unavailable") == 1


async def test_close_unlinks_every_segment() -> None:
    pool = ImagePool(processes=1)
    await pool.analyze(image_bytes("PNG", (30, 30)), TARGET)
    names = [s.name for s in pool._segments._segments if s is not None]
    assert names and all(Path("/dev/shm", name).exists() for name in names)
    pool.close()
    assert not any(Path("/dev/shm", name).exists() for name in names)


def test_segments_are_whole_steps() -> None:
    segments = pool_module.SharedSegments(1)
    try:
        segment = segments._fitted(0, 10)
        assert segment.size == pool_module.SHARED_SEGMENT_STEP
        assert segments._fitted(0, pool_module.SHARED_SEGMENT_STEP + 1).size == 2 * pool_module.SHARED_SEGMENT_STEP
    finally:
        segments.close()
