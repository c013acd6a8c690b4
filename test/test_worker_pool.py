"""Bodies in shared memory and the pool that reads them: right bytes to the right task, the socket when it must."""
from __future__ import annotations

import asyncio
import errno
import os
import pickle
import resource
import signal

import pytest

import worker.imaging.pool as pool_module
from test.worker_fakes import image_bytes, kill_and_wait, process_gone
from worker.fetching import shared_memory
from worker.constants import IMAGE_PROCESS_NICENESS, SEGMENT_STEP
from worker.imaging.analysis import analyze
from worker.imaging.pool import ImagePool, PoolProcess
from worker.imaging.pool_process import DONE
from worker.fetching.shared_memory import Body, Segment, SegmentPool, SegmentUnavailable

TARGET = 64
SPAN = 5 << 20


async def call(process: PoolProcess, function, *args):
    """``function(*args)`` in ``process``, through the request stream the pool drives it by."""
    outcome, value = await process.call(pickle.dumps((function, args), protocol=pickle.HIGHEST_PROTOCOL))
    assert outcome == DONE, value
    return value


def in_segment(segments: SegmentPool, data: bytes) -> Body:
    """``data`` written into a segment the way a download fills one: window by window."""
    segment = segments.take()
    offset = 0
    while offset < len(data):
        window = segment.window(offset)
        count = min(len(window), len(data) - offset)
        window[:count] = data[offset:offset + count]
        offset += count
    return Body(len(data), segment, segments)


async def test_concurrent_analyses_each_get_their_own_image_back() -> None:
    """Many bodies in their own segments at once, of growing sizes, then reused for others."""
    pool, segments = ImagePool(processes=2), SegmentPool(SPAN)
    sizes = [(20 + 37 * i, 10 + 23 * i) for i in range(24)]

    async def analyze(data: bytes):
        body = in_segment(segments, data)
        assert body.path is not None
        try:
            return await pool.analyze(body, TARGET)
        finally:
            body.release()
    try:
        results = await asyncio.gather(*(analyze(image_bytes("PNG", size)) for size in sizes))
        assert [(r.width, r.height) for r in results] == sizes
        results = await asyncio.gather(*(analyze(image_bytes("JPEG", size)) for size in reversed(sizes)))
        assert [(r.width, r.height) for r in results] == list(reversed(sizes))
    finally:
        pool.close()
        segments.close()


async def test_a_body_outside_shared_memory_goes_through_the_socket() -> None:
    """Plain bytes, or a body a server sent gzipped (decoded into bytes)."""
    data = image_bytes("JPEG", (300, 200), quality=77)
    pool = ImagePool(processes=1)
    try:
        for body in (data, Body.of(data)):
            result = await pool.analyze(body, TARGET)
            assert (result.width, result.height, result.compression_quality) == (300, 200, 77)
    finally:
        pool.close()


async def test_a_pool_process_that_cannot_read_segments_turns_them_off(monkeypatch, capsys) -> None:
    """As where /proc hides other processes: the socket carries this image and every later one."""
    monkeypatch.setattr(Segment, "path", property(lambda self: f"/proc/{os.getpid()}/fd/999999"))
    pool, segments = ImagePool(processes=1), SegmentPool(SPAN)
    try:
        for size in ((40, 30), (50, 60), (70, 20)):
            body = in_segment(segments, image_bytes("PNG", size))
            result = await pool.analyze(body, TARGET)
            body.release()
            assert (result.width, result.height) == size
        assert pool.shares_memory is False
    finally:
        pool.close()
        segments.close()
    assert capsys.readouterr().out.count("image_shared_memory_unavailable") == 1


def test_a_segment_is_backed_a_step_at_a_time_as_bytes_arrive() -> None:
    """A server that announces 50 MB and trickles holds what it sent, not what it announced."""
    segment = Segment(3 * SEGMENT_STEP + 10)
    try:
        assert segment.backed == 0
        assert len(segment.window(0)) == SEGMENT_STEP and segment.backed == SEGMENT_STEP
        assert len(segment.window(100)) == SEGMENT_STEP - 100  # no more until the step is full
        assert len(segment.window(SEGMENT_STEP)) == SEGMENT_STEP
        assert len(segment.window(3 * SEGMENT_STEP)) == 10  # the last step stops at the span
        assert len(segment.window(3 * SEGMENT_STEP + 10)) == 0  # full: the caller sees TooLarge
        assert os.fstat(segment.fd).st_blocks * 512 >= 3 * SEGMENT_STEP  # really reserved
    finally:
        segment.close()
    assert segment.fd is None


def test_idle_segments_are_kept_for_reuse_up_to_a_memory_bound(monkeypatch) -> None:
    monkeypatch.setattr(shared_memory, "IDLE_SEGMENT_BYTES", 2 * SEGMENT_STEP)
    segments = SegmentPool(SPAN)
    bodies = [in_segment(segments, b"x" * (SEGMENT_STEP // 2)) for _ in range(3)]
    fds = [body.segment.fd for body in bodies]
    for body in bodies:
        body.release()
        body.release()  # twice is harmless
    assert segments.idle_count == 2
    for fd in fds[:2]:
        os.fstat(fd)  # the two within the bound are kept open
    with pytest.raises(OSError):
        os.fstat(fds[2])  # the one over the bound was closed
    assert segments.take().fd == fds[1]  # reused, pages already backed
    assert segments.idle_count == 1
    segments.close()
    with pytest.raises(OSError):
        os.fstat(fds[0])


def test_no_memory_for_a_body_is_segment_unavailable(monkeypatch) -> None:
    def no_memory(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", no_memory)
    segment = Segment(SPAN)
    try:
        with pytest.raises(SegmentUnavailable):
            segment.window(0)
    finally:
        segment.close()


async def test_an_image_that_kills_its_process_twice_is_an_error_and_the_pool_goes_on(capsys) -> None:
    """Its process dies under it (killed here, stopped first so that it cannot answer), and
    so does the new one it is tried again in."""
    pool = ImagePool(processes=1)
    try:
        (first,) = pool.process_ids()
        os.kill(first, signal.SIGSTOP)
        crashing = asyncio.create_task(pool.analyze(image_bytes("PNG", (30, 40)), TARGET))
        await asyncio.sleep(0.1)
        kill_and_wait(first)
        async with asyncio.timeout(30):
            while pool.process_ids() == [first]:
                await asyncio.sleep(0)
        (second,) = pool.process_ids()
        os.kill(second, signal.SIGSTOP)  # at once: a new process is still starting, far from answering
        kill_and_wait(second)
        assert await asyncio.wait_for(crashing, 30) == pool_module.Analysis(error=pool_module.CRASHED)
        result = await pool.analyze(image_bytes("PNG", (40, 30)), TARGET)
        assert (result.width, result.height) == (40, 30)
    finally:
        pool.close()
    assert capsys.readouterr().out.count("image_pool_broken") == 2  # tried once more, in a new process


async def test_a_process_that_never_answers_ends_its_image_and_the_one_queued_behind_goes_again(capsys) -> None:
    """A decoder stuck for good (here: asleep) must not hold its task, or the one queued behind
    it, forever: past the timeout the image is an error, the process is replaced, and the
    queued image is analysed in the new one."""
    pool = ImagePool(processes=1, timeout=5.0)  # a new process starts well within it, even on a busy machine
    try:
        (pid,) = pool.process_ids()
        os.kill(pid, signal.SIGSTOP)  # it will never answer
        stuck = asyncio.create_task(pool.analyze(image_bytes("PNG", (30, 40)), TARGET))
        await asyncio.sleep(0.1)
        queued = asyncio.create_task(pool.analyze(image_bytes("PNG", (50, 20)), TARGET))
        assert await asyncio.wait_for(stuck, 30) == pool_module.Analysis(error=pool_module.TIMED_OUT)
        first = await asyncio.wait_for(queued, 30)
        assert (first.width, first.height) == (50, 20)
        assert process_gone(pid)  # replaced: killed and reaped
        pids = pool.process_ids()
    finally:
        pool.close()
    assert all(process_gone(pid) for pid in pids)
    assert capsys.readouterr().out.count("image_pool_broken") == 2  # the stuck one, the queued one


async def test_a_cancelled_analysis_leaves_no_stale_answer_for_the_next_one() -> None:
    """Its answer still arrives, behind the queued one, and is dropped."""
    pool = ImagePool(processes=1)
    try:
        await pool.analyze(image_bytes("PNG", (20, 10)), TARGET)  # the process has started
        (pid,) = pool.process_ids()
        os.kill(pid, signal.SIGSTOP)  # holds every answer until it goes on
        slow = asyncio.create_task(pool.analyze(image_bytes("PNG", (30, 40)), TARGET))
        queued = asyncio.create_task(pool.analyze(image_bytes("PNG", (50, 20)), TARGET))
        await asyncio.sleep(0.1)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        os.kill(pid, signal.SIGCONT)  # the cancelled one's answer comes first
        first = await asyncio.wait_for(queued, 10)
        second = await asyncio.wait_for(pool.analyze(image_bytes("PNG", (70, 10)), TARGET), 10)
        assert [(r.width, r.height) for r in (first, second)] == [(50, 20), (70, 10)]
        assert pool.process_ids() == [pid]  # the same process: the stream stayed in step
        pids = pool.process_ids()
    finally:
        pool.close()
    assert all(process_gone(pid) for pid in pids)  # close() leaves none behind


async def test_image_processes_yield_the_cpu_to_the_event_loop() -> None:
    """On a busy machine the image work, not the loop that spaces requests, waits."""
    pool = ImagePool(processes=1)
    try:
        await pool.analyze(image_bytes("PNG", (20, 10)), TARGET)  # the process has started
        (pid,) = pool.process_ids()
        assert os.getpriority(os.PRIO_PROCESS, pid) == min(os.nice(0) + IMAGE_PROCESS_NICENESS, 19)
    finally:
        pool.close()


def faults_of_analyses(images: list[bytes]) -> int:
    """Run in a pool process: the page faults of analysing ``images`` twice, after once."""
    for data in images:
        analyze(data, 640)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for data in images * 2:
        analyze(data, 640)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


async def test_a_pool_process_reuses_the_memory_of_its_last_images() -> None:
    """Large images, decoded to 8-10 MB each: given back to the kernel after each image, their
    pages came back as ~9,000 page faults in these six analyses (~1,100 kept; docs/decisions.md)."""
    images = [image_bytes("WEBP", (1600, 1565)), image_bytes("PNG", (1309, 1600)), image_bytes("JPEG", (1600, 1033))]
    process = PoolProcess.start()
    try:
        faults = await call(process, faults_of_analyses, images)
    finally:
        process.close()
    assert faults < 3000


async def test_answers_bigger_than_one_read_or_several_in_one_read_each_arrive_whole() -> None:
    process = PoolProcess.start()
    sizes = [3, 600_000, 10, 1_000_000, 7, 0, 300_000, 5, 6]
    try:
        answers = await asyncio.gather(*(call(process, os.urandom, size) for size in sizes))
        assert [len(answer) for answer in answers] == sizes
    finally:
        process.close()


async def test_without_memfd_a_body_is_anonymous_memory_sent_through_the_socket(monkeypatch) -> None:
    """As on macOS, a developer's box: the same bodies, no path for the pool to open."""
    monkeypatch.delattr(os, "memfd_create")
    pool, segments = ImagePool(processes=1), SegmentPool(SPAN)
    try:
        body = in_segment(segments, image_bytes("JPEG", (120, 90)))
        assert body.path is None and body.segment.fd is None
        result = await pool.analyze(body, TARGET)
        body.release()
        assert (result.width, result.height) == (120, 90)
    finally:
        pool.close()
        segments.close()
