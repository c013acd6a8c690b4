"""The pool's shared-memory hand-off: right bytes to the right task, and the socket when it must."""
from __future__ import annotations

import asyncio
import os
import time

import pytest

import worker.pool as pool_module
from test.worker_fakes import image_bytes
from worker.constants import IMAGE_PROCESS_NICENESS
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


def in_chunks(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("segment_max", [16 << 20, 100], ids=["segment", "socket"])
async def test_a_body_in_chunks_is_put_back_together_in_order(monkeypatch, segment_max: int) -> None:
    """As the fetcher hands it over: the chunks it arrived in, of uneven sizes."""
    monkeypatch.setattr(pool_module, "SHARED_SEGMENT_MAX", segment_max)
    data = image_bytes("JPEG", (300, 200), quality=77)
    pool = ImagePool(processes=1)
    try:
        whole = await pool.analyze(data, TARGET)
        chunked = await pool.analyze(in_chunks(data[:500], 100) + [b""] + in_chunks(data[500:], 333), TARGET)
    finally:
        pool.close()
    assert (whole.width, whole.height, whole.compression_quality) == (300, 200, 77)
    assert chunked == whole


async def test_a_body_over_the_segment_cap_goes_through_the_socket(monkeypatch) -> None:
    monkeypatch.setattr(pool_module, "SHARED_SEGMENT_MAX", 100)
    pool = ImagePool(processes=1)
    try:
        result = await pool.analyze(image_bytes("JPEG", (300, 200)), TARGET)
        assert (result.width, result.height) == (300, 200)
        assert pool._segments._segments == [None, None]  # never used
    finally:
        pool.close()


async def test_no_memory_for_a_segment_falls_back_to_the_socket_and_says_so_once(monkeypatch, capsys) -> None:
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
    """As where /proc hides other processes: the socket carries this image and every later one."""
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


async def test_an_image_that_kills_its_process_twice_is_an_error_and_the_pool_goes_on(capsys) -> None:
    pool = ImagePool(processes=1)
    try:
        assert await pool._run(1, os._exit, 9) == pool_module.Analysis(error=pool_module.CRASHED)
        result = await pool.analyze(image_bytes("PNG", (40, 30)), TARGET)
        assert (result.width, result.height) == (40, 30)
    finally:
        pool.close()
    assert capsys.readouterr().out.count("image_pool_broken") == 2  # tried once more, in a new process


async def test_a_cancelled_analysis_leaves_no_stale_answer_for_the_next_one() -> None:
    """Its answer still arrives, behind the queued one, and is dropped."""
    pool = ImagePool(processes=1)
    try:
        slow = asyncio.create_task(pool._run(1, time.sleep, 0.5))
        queued = asyncio.create_task(pool.analyze(image_bytes("PNG", (50, 20)), TARGET))
        await asyncio.sleep(0.1)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        first = await asyncio.wait_for(queued, 10)
        second = await asyncio.wait_for(pool.analyze(image_bytes("PNG", (70, 10)), TARGET), 10)
        assert [(r.width, r.height) for r in (first, second)] == [(50, 20), (70, 10)]
        processes = [pooled.process for pooled in pool._processes]
    finally:
        pool.close()
    assert not any(process.is_alive() for process in processes)  # close() leaves none behind


async def test_image_processes_yield_the_cpu_to_the_event_loop() -> None:
    """On a busy machine the image work, not the loop that spaces requests, waits."""
    pool = ImagePool(processes=1)
    try:
        await pool.analyze(image_bytes("PNG", (20, 10)), TARGET)  # the process has started
        assert await pool._run(1, os.nice, 0) == min(os.nice(0) + IMAGE_PROCESS_NICENESS, 19)
    finally:
        pool.close()


async def test_answers_bigger_than_one_read_or_several_in_one_read_each_arrive_whole() -> None:
    pool = ImagePool(processes=1)
    sizes = [3, 600_000, 10, 1_000_000, 7, 0, 300_000, 5, 6]
    try:
        answers = await asyncio.gather(*(pool._run(1, os.urandom, size) for size in sizes))
        assert [len(answer) for answer in answers] == sizes
    finally:
        pool.close()
