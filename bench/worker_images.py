"""Worker image throughput: ``python -m bench.worker_images [--stack] [--seconds S]``.

Three corpora (icons, ~1 MP photos, ~12 MP photos, made from scikit-image's
sample photos) are served by a lean local HTTP server in its own process
(its CPU per image in the worker's runs is shown: it competes with the
worker for the same cores, which the bare loop does not). For each corpus,
side by side in one run:

- bare: decode, thumbnail, encode in a process pool of the pool's size;
- worker: ``ImageTask.process`` per URL (fetch with tokens and gate, the
  process pool's ``analyze``, thumbnail store, Kafka messages, Redis stats);
- download: plain GETs of the same URLs in the same process, by the worker's
  client into shared memory (the same bytes with ``Content-Length`` and
  chunked in 64 KiB chunks, side by side: llhttp parses the chunked framing,
  a Content-Length body is received straight into the segment), and by
  aiohttp for comparison; and by curl (C, to /dev/null, one keep-alive
  connection): the least CPU a client pays to receive the bytes on this
  machine, kernel included (shown for scale). ``--compare FILE`` adds another
  version of ``worker/fetching/http_client.py`` (a copy of an older one, say) as one
  more contender on the Content-Length URLs, measured in the same rounds.

Kafka, Redis and S3 are in-memory stand-ins by default, so "CPU outside the
image work" (the worker process's own CPU per image; the pool's CPU is not
counted) measures the worker's code; ``--stack`` uses the real clients on a
local stack instead; ``--downloads`` measures the downloads alone (quick).
Targets: worker rate >= 90% of bare on the 1 and 12 MP corpora; <= 2 ms CPU per
image outside the image work; a chunked body costs at most 1.5x the same body
with Content-Length.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import AsyncExitStack
from multiprocessing import get_context
from pathlib import Path
from collections.abc import Awaitable, Callable

import aiohttp
from PIL import Image

from bench.cpu import proc_cpu
from common.contracts import CrawlRequest, tokens_key
from common.settings import Settings
from devstack.servers import free_port
from test.worker_fakes import AllowAllGate, FakeProducer, FakeRedis, FakeThumbnails
from worker.constants import THUMBNAIL_JPEG_QUALITY, THUMBNAIL_REDUCING_GAP
from worker.fetching.fetch import Fetcher
from worker.fetching.http_client import HttpClient
from worker.imaging.analysis import RESAMPLE
from worker.imaging.pool import ImagePool, default_pool_size
from worker.outcomes.stats import RECORD
from worker.fetching.shared_memory import SegmentPool
from worker.outcomes.stats import Stats
from worker.outcomes.task import ImageTask
from worker.fetching.tokens import TokenBuckets

TARGET = 640
SOURCE = "bench"
CONCURRENCY_PER_PROCESS = 4
ROUNDS = 4
MAX_BYTES = 50 * 1024 * 1024


def sample_photos() -> list[Image.Image]:
    import skimage.data as data
    names = ["astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field",
             "retina", "cat"]
    return [Image.fromarray(getattr(data, name)()) for name in names]


def corpora(folder: Path) -> dict[str, list[str]]:
    """Write the three corpora as files; return corpus -> relative paths."""
    photos = sample_photos()
    logo = Image.fromarray(__import__("skimage.data", fromlist=["logo"]).logo())  # RGBA
    out: dict[str, list[str]] = {"icons": [], "1mp": [], "12mp": []}

    def save(corpus: str, name: str, image: Image.Image, fmt: str, **kwargs) -> None:
        path = folder / corpus / name
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path, fmt, **kwargs)
        out[corpus].append(f"{corpus}/{name}")

    for i in range(120):
        source = [logo, *photos][i % (len(photos) + 1)]
        size = (32, 48, 64)[i % 3]
        save("icons", f"{i}.png", source.resize((size, size)), "PNG")
    for i in range(32):
        scale = 0.9 + 0.05 * (i % 5)
        save("1mp", f"{i}.jpg", camera_like(photos[i % len(photos)], 1_000_000 * scale ** 2), "JPEG", quality=88)
    for i in range(8):
        save("12mp", f"{i}.jpg", camera_like(photos[i % len(photos)], 12_000_000), "JPEG", quality=90)
    return out


def camera_like(photo: Image.Image, pixels: float) -> Image.Image:
    """``photo`` upscaled to ``pixels`` with sensor-like noise, so it compresses like a camera's
    JPEG (~3 MB at 12 MP) rather than like a smooth upscale (~1 MB)."""
    scale = (pixels / (photo.width * photo.height)) ** 0.5
    big = photo.resize((round(photo.width * scale), round(photo.height * scale)))
    return Image.blend(big, Image.effect_noise(big.size, 32).convert("RGB"), 0.2)


# The stand-in for the web: keep-alive HTTP/1.1, bodies by sendfile. It shares the machine's
# cores with the contenders, and only the worker's side pays for it, so it must cost little:
# aiohttp's static files cost 0.7-1.8 ms of CPU per image here, more than the worker itself.
# Under /chunked/ the same files go out chunked, 64 KiB a chunk, framed in advance.
SERVER = """
import asyncio, os, sys
from pathlib import Path
root = Path(sys.argv[1])
files = {"/" + p.relative_to(root).as_posix(): open(p, "rb") for p in root.rglob("*") if p.is_file()}
CHUNK = 64 << 10

def chunked(data):
    pieces = [b"%x\\r\\n%s\\r\\n" % (len(data[i:i + CHUNK]), data[i:i + CHUNK])
              for i in range(0, len(data), CHUNK)]
    return b"HTTP/1.1 200 OK\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n" + b"".join(pieces) + b"0\\r\\n\\r\\n"

framed = {"/chunked" + path: chunked(Path(file.name).read_bytes()) for path, file in files.items()}

async def serve(reader, writer):
    loop = asyncio.get_running_loop()
    try:
        while True:
            path = (await reader.readuntil(b"\\r\\n\\r\\n")).split(b" ", 2)[1].decode()
            if path in framed:
                writer.write(framed[path])
                await writer.drain()
                continue
            file = files.get(path)
            size = os.fstat(file.fileno()).st_size if file else 0
            writer.write(b"HTTP/1.1 %s\\r\\nContent-Length: %d\\r\\n\\r\\n"
                         % (b"200 OK" if file else b"404 Not Found", size))
            if file:
                await loop.sendfile(writer.transport, file, 0, size)
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()

async def main():
    async with await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[2])) as server:
        await server.serve_forever()

asyncio.run(main())
"""


def bare(data: bytes) -> int:
    """The least a thumbnailer can do: decode, thumbnail, encode."""
    with Image.open(io.BytesIO(data)) as image:
        image.thumbnail((TARGET, TARGET), RESAMPLE, reducing_gap=THUMBNAIL_REDUCING_GAP)
        out = io.BytesIO()
        image.convert("RGB").save(out, "JPEG", quality=THUMBNAIL_JPEG_QUALITY)
    return len(out.getvalue())


def run_bare(executor: ProcessPoolExecutor, blobs: list[bytes], seconds: float) -> tuple[int, float]:
    """(images, seconds) of the bare loop."""
    started, done = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        list(executor.map(bare, blobs, chunksize=1))
        done += len(blobs)
    return done, time.perf_counter() - started


async def run_worker(task: ImageTask, urls: list[str], seconds: float, concurrency: int) -> tuple[int, float, float]:
    """(images, seconds, worker-process CPU seconds) of the worker's path."""
    started, cpu_started = time.perf_counter(), time.process_time()
    done = 0

    async def one_worker() -> None:
        nonlocal done
        while time.perf_counter() - started < seconds:
            url = urls[done % len(urls)]
            done += 1
            await task.process(CrawlRequest(url, f"u{done}", SOURCE))

    await asyncio.gather(*(one_worker() for _ in range(concurrency)))
    return done, time.perf_counter() - started, time.process_time() - cpu_started


async def run_download(get: Callable[[str], Awaitable[None]], urls: list[str], seconds: float,
                       concurrency: int) -> tuple[int, float]:
    """(images, process CPU seconds) of bare downloads: the bytes' own cost."""
    started, cpu_started = time.perf_counter(), time.process_time()
    done = 0

    async def one_client() -> None:
        nonlocal done
        while time.perf_counter() - started < seconds:
            done += 1
            await get(urls[done % len(urls)])

    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return done, time.process_time() - cpu_started


Get = Callable[[str], Awaitable[None]]


def downloads(clients: dict[str, HttpClient], session: aiohttp.ClientSession) -> dict[str, tuple[Get, str]]:
    """Contender -> (get, URL prefix): each of ``clients`` on the Content-Length URLs, ours on
    the chunked ones too, and aiohttp."""
    segments = SegmentPool(MAX_BYTES + 1)

    def into_segments(client: HttpClient) -> Get:
        async def get(url: str) -> None:
            async with client.get(url) as response:
                (await response.read_body(segments, MAX_BYTES)).release()
        return get

    async def with_aiohttp(url: str) -> None:
        async with session.get(url) as response:
            async for _chunk in response.content.iter_any():  # no join: the least aiohttp does
                pass
    contenders = {f"{name} CL": (into_segments(client), "") for name, client in clients.items()}
    contenders["ours chunked"] = (into_segments(clients["ours"]), "/chunked")
    contenders["aiohttp"] = (with_aiohttp, "")
    return contenders


def compared_client(path: str) -> type[HttpClient]:
    """``HttpClient`` from another copy of worker/fetching/http_client.py, for a before/after in one run."""
    spec = importlib.util.spec_from_file_location("compared_http_client", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.HttpClient


def curl_download(urls: list[str], count: int) -> tuple[int, float]:
    """(images, CPU seconds, user + kernel) of curl fetching ``count`` of ``urls`` to /dev/null
    over one keep-alive connection; (count, nan) without curl."""
    if shutil.which("curl") is None:
        return count, float("nan")
    args = ["curl", "--silent", "--fail"]
    for i in range(count):
        args += [urls[i % len(urls)], "--output", "/dev/null"]
    process = subprocess.Popen(args)
    _pid, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, for its rusage
    if process.returncode != 0:
        raise RuntimeError(f"curl failed with exit code {process.returncode}")
    return count, usage.ru_utime + usage.ru_stime


async def sinks(stack: AsyncExitStack, use_stack: bool):
    """(redis, producer, thumbnails): in-memory, or the real clients on a local stack."""
    if not use_stack:
        return _NullRedis(), _NullProducer(), FakeThumbnails()
    from common.redis_client import bounded_redis
    from worker.constants import REDIS_MAX_CONNECTIONS
    from common.kafka import AsyncProducer, producer_config
    from devstack.stack import LocalStack
    from worker.imaging.thumbnails import s3_thumbnails
    addresses = stack.enter_context(LocalStack())
    settings = Settings.from_env(addresses.environment())
    redis = bounded_redis(addresses.redis_url, REDIS_MAX_CONNECTIONS)  # the worker's own client
    stack.push_async_callback(redis.aclose)
    await redis.set(tokens_key(SOURCE), 10**12)  # no regulator here: every request may go
    producer = AsyncProducer(producer_config(addresses.kafka_hosts))
    stack.push_async_callback(producer.close)
    thumbnails = await stack.enter_async_context(s3_thumbnails(settings))
    return redis, producer, thumbnails


class _NullProducer(FakeProducer):
    async def send(self, topic: str, value: bytes, key=None) -> None:
        return None


class _NullRedis(FakeRedis):
    """Tokens always available, writes dropped: what is left is the worker's own cost."""

    async def get(self, key: str) -> str:
        return "1000000"

    async def mget(self, keys: list[str]) -> list[str]:  # the token peeks (TokenBuckets._peek_all)
        return ["1000000"] * len(keys)

    def register_script(self, script: str):
        async def always_a_token(keys: list[str], args: list[str]) -> list:
            return [0, 1_000_000, "0"]

        async def recorded(keys: list[str], args: list[str]) -> list:
            return []  # stats.RECORD: no command failed
        return recorded if script == RECORD else always_a_token

    def pipeline(self, transaction: bool = True):
        return _NullPipeline()


class _NullPipeline:
    def __getattr__(self, name: str):
        return lambda *args, **kwargs: self

    async def execute(self) -> list:
        return []


async def main_async(args: argparse.Namespace) -> None:
    folder = Path(tempfile.mkdtemp(prefix="bench-images-"))
    paths = corpora(folder)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(folder), str(port)])
    processes = default_pool_size()
    executor = ProcessPoolExecutor(processes, mp_context=get_context("spawn"))
    pool = ImagePool(processes)
    rows = []
    try:
        async with AsyncExitStack() as stack:
            redis, producer, thumbnails = await sinks(stack, args.stack)
            session = await stack.enter_async_context(aiohttp.ClientSession())
            await _wait_for_server(session, port)
            clients = {"ours": HttpClient("bench")}
            if args.compare:
                clients["compared"] = compared_client(args.compare)("bench")
            for one in clients.values():
                stack.push_async_callback(one.close)
            fetcher = Fetcher(clients["ours"], AllowAllGate(), TokenBuckets(redis), MAX_BYTES)
            plain = downloads(clients, session)
            task = ImageTask(fetcher, pool.analyze, thumbnails, producer, Stats(redis),
                             Settings(target_resolution=TARGET))
            list(executor.map(bare, [(folder / paths["icons"][0]).read_bytes()] * processes))  # warm up
            await task.process(CrawlRequest(f"http://127.0.0.1:{port}/{paths['icons'][0]}", "warm", SOURCE))
            for corpus, names in paths.items():
                blobs = [(folder / name).read_bytes() for name in names]
                urls = [f"http://127.0.0.1:{port}/{name}" for name in names]
                # Alternating rounds, so a neighbour's load on this shared machine hits both alike.
                bare_n = bare_s = worker_n = worker_s = worker_cpu = server_cpu = 0.0
                download = {name: [0, 0.0] for name in (*plain, "curl")}  # images, CPU seconds
                for _round in range(ROUNDS):
                    if not args.downloads:
                        n, seconds = run_bare(executor, blobs, args.seconds / ROUNDS)
                        bare_n, bare_s = bare_n + n, bare_s + seconds
                        server_started = proc_cpu([server.pid])
                        n, seconds, cpu = await run_worker(task, urls, args.seconds / ROUNDS,
                                                           processes * CONCURRENCY_PER_PROCESS)
                        worker_n, worker_s, worker_cpu = worker_n + n, worker_s + seconds, worker_cpu + cpu
                        server_cpu += proc_cpu([server.pid]) - server_started
                    for name, (get, prefix) in plain.items():
                        n, cpu = await run_download(get, [f"http://127.0.0.1:{port}{prefix}/{name}" for name in names],
                                                    args.seconds / ROUNDS / 8, processes * CONCURRENCY_PER_PROCESS)
                        download[name][0] += n
                        download[name][1] += cpu
                    n, cpu = curl_download(urls, max(8, int(download["ours CL"][0] / (_round + 1))))
                    download["curl"][0] += n
                    download["curl"][1] += cpu
                nan = float("nan")
                bare_rate, rate = bare_n / bare_s if bare_s else nan, worker_n / worker_s if worker_s else nan
                mean_kb = sum(map(len, blobs)) / len(blobs) / 1024
                rows.append((corpus, mean_kb, bare_rate, rate, rate / bare_rate,
                             worker_cpu * 1000 / worker_n if worker_n else nan,
                             {name: cpu * 1000 / n for name, (n, cpu) in download.items()},
                             server_cpu * 1000 / worker_n if worker_n else nan, int(worker_n)))
    finally:
        pool.close()
        executor.shutdown()
        server.terminate()
        server.wait()
    print(f"\npool processes: {processes}; sinks: {'local stack (real clients)' if args.stack else 'in-memory'}; "
          f"load average before: {os.getloadavg()[0]:.2f}"
          + (f"; compared: {args.compare}" if args.compare else ""))
    contenders = list(rows[0][6])
    print(f"{'corpus':<8}{'mean KB':>9}{'bare img/s':>12}{'worker img/s':>14}{'ratio':>8}"
          f"{'worker CPU ms/img':>19}" + "".join(f"{name:>{max(len(name) + 2, 8)}}" for name in contenders)
          + f"{'site CPU ms/img':>17}{'images':>8}")
    print(f"{'':<70}(download CPU ms/img)")
    for corpus, kb, bare_rate, rate, ratio, cpu_ms, download_ms, server_ms, done in rows:
        print(f"{corpus:<8}{kb:>9.0f}{bare_rate:>12.1f}{rate:>14.1f}{ratio:>8.0%}{cpu_ms:>19.2f}"
              + "".join(f"{download_ms[name]:>{max(len(name) + 2, 8)}.2f}" for name in contenders)
              + f"{server_ms:>17.2f}{done:>8}")


async def _wait_for_server(session: aiohttp.ClientSession, port: int) -> None:
    for _ in range(100):
        try:
            async with session.get(f"http://127.0.0.1:{port}/"):
                return
        except aiohttp.ClientError:
            await asyncio.sleep(0.1)
    raise RuntimeError("the image server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", action="store_true", help="real Kafka, Redis and S3 on a local stack")
    parser.add_argument("--seconds", type=float, default=8.0, help="per corpus and contender")
    parser.add_argument("--downloads", action="store_true", help="the downloads alone, not bare or worker")
    parser.add_argument("--compare", metavar="FILE", help="another worker/fetching/http_client.py, as one more client")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
