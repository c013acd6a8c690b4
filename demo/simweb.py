"""A simulated web on loopback: one aiohttp server per source, each with its own manners.

The end-to-end tests, the demo and the benchmark need websites whose
behaviour they choose (size, latency, 500s, 429 with Retry-After, robots.txt)
and whose own log of requests is the evidence for politeness: the crawler's
word about its rate proves nothing, the server's arrival times do. Sources
are told apart by port, on 127.0.0.1 unless a site names another loopback
address (``SiteSpec.host``: the per-host cap keys on the host). A site may
have a fixed number of server slots (``slots``), each busy ``latency``
seconds a request, so that a crawler faster than its capacity makes it queue.

Arrival times are the kernel's receive timestamps (``SO_TIMESTAMPNS``), not
the handler's clock: on a 2-core machine the crawl can keep this loop off the
CPU for a few hundred milliseconds, and requests read late would be logged
bunched together, a burst the crawler never sent.

``python -m demo.simweb OUT_DIR`` serves the standard test web from a
subprocess until SIGTERM, writing ``sources.json``, ``urls.tsv`` and one JSON
line per request to ``requests.jsonl`` in OUT_DIR.
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import csv
import io
import json
import random
import signal
import socket
import struct
import threading
import time
import uuid as uuidlib
from contextlib import contextmanager
from itertools import pairwise
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import IO
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
from aiohttp import web
from PIL import Image
from protego import Protego

from common.contracts import allowed_per_second
from demo.outcomes import CRAWL_ERRORS, LINK_ROT, OPTED_OUT, QUALITY

HOST = "127.0.0.1"
ROBOTS_PATH = "/robots.txt"
TDMREP_PATH = "/.well-known/tdmrep.json"
RULES_PATHS = (ROBOTS_PATH, TDMREP_PATH)  # per-origin files: fetched once a day, never throttled
STREAM_BYTES = 256 * 1024   # a body this long is written in chunks, and the bytes sent are logged
STREAM_CHUNK = 64 * 1024
CONTENT_TYPES = {"jpg": "image/jpeg", "png": "image/png", "gif": "image/gif", "webp": "image/webp"}
# Paths the standard web uses; their expected outcome is the test's oracle.
IMAGE, MISSING, GONE, BROKEN, PRIVATE = "/img/", "/missing/", "/gone/", "/broken/", "/private/"
DISALLOW_PRIVATE = "User-agent: *\nDisallow: /private/\n"
CLOCK_SLACK = 0.1  # arrival jitter (s) allowed on Crawl-delay spacing


# --- The SPEC's computed rate (SPEC.md §3), written independently of the monitor as the oracle.
RATE_POINTS = ((5_000, 1.0), (500_000_000, 200.0))


def spec_rate(image_count: int) -> float:
    (x0, y0), (x1, y1) = RATE_POINTS
    clamped = min(max(image_count, x0), x1)
    return y0 + (clamped - x0) * (y1 - y0) / (x1 - x0)


def image_count_for_rate(rate: float) -> int:
    """The sources-list size that gives ``rate`` req/s."""
    (x0, y0), (x1, y1) = RATE_POINTS
    return round(x0 + (rate - y0) * (x1 - x0) / (y1 - y0))


@dataclass
class SiteSpec:
    """One source's website. Paths not in ``files`` are 404; ``/gone/...`` is 410."""

    name: str
    image_count: int
    files: Mapping[str, bytes] = field(default_factory=dict, repr=False)
    latency: float = 0.0
    error_rate: float = 0.0      # share of requests answered 500
    throttle_every: int = 0      # every Nth request is answered 429 with Retry-After
    retry_after: int = 3
    robots_txt: str | None = None  # None: /robots.txt is 404 (everything allowed)
    seed: int = 0
    slots: int = 0               # requests served at once, each for ``latency`` s; 0: no limit
    host: str = HOST             # any 127.x.y.z: distinct hosts get distinct per-host caps
    tdmrep_json: str | None = None  # /.well-known/tdmrep.json; None: 404
    redirects: Mapping[str, str] = field(default_factory=dict)  # path -> Location of a 301 (before the rest)
    # Response headers by path prefix (X-Robots-Tag, tdm-reservation, Content-Usage...).
    path_headers: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    port: int = 0                # 0: a free one; a fixed port puts it in URLs known before serving


_SO_TIMESTAMPNS = 35  # Linux's option and its control message: a struct timespec per read
_TIMESPEC = struct.Struct("@qq")


class _StampedSocket(socket.socket):
    """A listening socket whose connections note when the kernel received what they read."""

    arrived = 0.0

    def accept(self) -> tuple[_StampedSocket, object]:
        fd, address = self._accept()
        return _StampedSocket(self.family, self.type, self.proto, fileno=fd), address

    def recv(self, size: int, flags: int = 0) -> bytes:
        data, ancillary, _flags, _address = self.recvmsg(size, socket.CMSG_SPACE(_TIMESPEC.size), flags)
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS:
                seconds, nanoseconds = _TIMESPEC.unpack(payload[:_TIMESPEC.size])
                self.arrived = seconds + nanoseconds / 1e9
        return data


def stamped_listener(host: str = HOST, port: int = 0) -> _StampedSocket:
    """A listening socket whose requests' arrival times ``arrival`` reads (kernel receive stamps)."""
    listener = _StampedSocket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Set here, it holds for every connection from its first packet, even one accepted late.
    listener.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    listener.bind((host, port))
    listener.listen(512)
    return listener


def arrival(request: web.Request) -> float:
    """When the kernel received the request (the handler may run much later)."""
    transport_socket = request.transport.get_extra_info("socket") if request.transport else None
    arrived = getattr(getattr(transport_socket, "_sock", transport_socket), "arrived", 0.0)
    return arrived or time.time()


@dataclass(frozen=True)
class RequestRecord:
    time: float  # wall clock at arrival
    site: str
    path: str
    status: int
    user_agent: str
    served_in: float = 0.0  # seconds from arrival to the answer: queueing for a slot, then service
    # A streamed body (STREAM_BYTES or longer): bytes the client's TCP acked by the end of the
    # handler (a body sent whole may show a little less: its last bytes were still in flight).
    sent_bytes: int | None = None


def fetches(log: Iterable[RequestRecord]) -> list[RequestRecord]:
    """The requests in ``log`` for a site's pages and images: not for its rules files (RULES_PATHS)."""
    return [r for r in log if r.path not in RULES_PATHS]


class Site:
    """A running website and its server-side request log."""

    def __init__(self, spec: SiteSpec, log_file: IO[str] | None = None):
        self.spec = spec
        self.log: list[RequestRecord] = []
        self.port = 0
        self.in_flight = self.max_in_flight = 0
        self._served = 0
        self._rng = random.Random(spec.seed)
        self._log_file = log_file
        self._slots = asyncio.Semaphore(spec.slots) if spec.slots else None

    @property
    def base_url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    async def handle(self, request: web.Request) -> web.StreamResponse:
        arrived = arrival(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self._slots is not None:
                async with self._slots:
                    await asyncio.sleep(self.spec.latency)
            elif self.spec.latency:
                await asyncio.sleep(self.spec.latency)
            response = self._respond(request.path)
        finally:
            self.in_flight -= 1
        sent = None
        body = response.body if isinstance(response.body, bytes) else b""
        if len(body) >= STREAM_BYTES:
            response, sent = await self._stream(request, response, body)
        record = RequestRecord(arrived, self.spec.name, request.path_qs, response.status,
                               request.headers.get("User-Agent", ""), time.time() - arrived, sent)
        self.log.append(record)
        if self._log_file is not None:
            self._log_file.write(json.dumps(asdict(record)) + "\n")
        return response

    @staticmethod
    async def _stream(request: web.Request, response: web.Response,
                      body: bytes) -> tuple[web.StreamResponse, int]:
        """Write ``body`` in chunks; returns the bytes the client's TCP acknowledged (the kernel's
        count, ``TCP_INFO``): what a site's own socket buffer took and then dropped at a reset
        never crossed the network."""
        stream = web.StreamResponse(status=response.status, headers=response.headers)
        stream.content_length = len(body)
        sock = request.transport.get_extra_info("socket") if request.transport else None
        before = acked = _bytes_acked(sock)  # a kept-alive connection's earlier responses
        try:
            await stream.prepare(request)
            for start in range(0, len(body), STREAM_CHUNK):
                await stream.write(body[start:start + STREAM_CHUNK])
                acked = max(acked, _bytes_acked(sock))
            await stream.write_eof()
        except (ConnectionError, RuntimeError):
            pass  # the client closed the connection
        return stream, max(acked, _bytes_acked(sock)) - before

    def _respond(self, path: str) -> web.Response:
        spec = self.spec
        if path in spec.redirects:
            return web.Response(status=301, headers={"Location": spec.redirects[path]})
        if path == ROBOTS_PATH:  # rules are never throttled: the crawler must be able to read them
            if spec.robots_txt is None:
                return web.Response(status=404)
            return web.Response(text=spec.robots_txt, content_type="text/plain")
        if path == TDMREP_PATH:
            if spec.tdmrep_json is None:
                return web.Response(status=404)
            return web.Response(text=spec.tdmrep_json, content_type="application/json")
        self._served += 1
        if spec.throttle_every and self._served % spec.throttle_every == 0:
            return web.Response(status=429, headers={"Retry-After": str(spec.retry_after)})
        if spec.error_rate and self._rng.random() < spec.error_rate:
            return web.Response(status=500, text="simulated failure")
        if path.startswith(GONE):
            return web.Response(status=410)
        body = spec.files.get(path)
        if body is None:
            return web.Response(status=404, text="not found")
        content_type = CONTENT_TYPES.get(path.rsplit(".", 1)[-1], "application/octet-stream")
        headers = {k: v for prefix, extra in spec.path_headers.items() if path.startswith(prefix)
                   for k, v in extra.items()}
        return web.Response(body=body, content_type=content_type, headers=headers)

    # --- Evidence -----------------------------------------------------------
    def requests(self, prefix: str = "") -> list[RequestRecord]:
        return [r for r in list(self.log) if r.path.startswith(prefix)]

    def throttled(self) -> list[RequestRecord]:
        return [r for r in list(self.log) if r.status == 429]

    def violations(self, rate_limit: float, user_agent: str, max_connections: int,
                   robots_fetches: int = 1, since: float = 0.0) -> list[str]:
        """Every way the crawler was impolite to this site, judged from the server's log alone.

        No sliding one-second window may hold more than floor(``rate_limit``) + 1 requests
        (``allowed_per_second``). After a 429, one second is allowed for requests already
        under way before the pause must show.
        """
        log = [r for r in list(self.log) if r.time >= since]
        asked = fetches(log)
        found = []
        times = sorted(r.time for r in asked)
        peak, at = busiest_second(times)
        if peak > allowed_per_second(rate_limit):
            found.append(f"{self.spec.name}: {peak} requests in one second, limit {rate_limit:.2f}/s "
                         f"(from {at - times[0]:.2f} s after its first request)")
        if sum(r.path == ROBOTS_PATH for r in log) > robots_fetches:
            found.append(f"{self.spec.name}: robots.txt fetched {sum(r.path == ROBOTS_PATH for r in log)} times")
        if self.max_in_flight > max_connections:
            found.append(f"{self.spec.name}: {self.max_in_flight} concurrent requests, cap {max_connections}")
        found += [f"{self.spec.name}: User-Agent {r.user_agent!r}" for r in log if r.user_agent != user_agent][:3]
        if self.spec.robots_txt is not None:
            robots = Protego.parse(self.spec.robots_txt)
            token = user_agent.split("/")[0]
            found += [f"{self.spec.name}: fetched {r.path}, disallowed by robots.txt"
                      for r in asked if not robots.can_fetch(self.url(r.path), token)][:3]
            delay = robots.crawl_delay(token)
            gaps = [b.time - a.time for a, b in pairwise(asked)]
            if delay and gaps and min(gaps) < delay - CLOCK_SLACK:
                found.append(f"{self.spec.name}: requests {min(gaps):.3f}s apart, Crawl-delay {delay}")
        for paused in (r for r in log if r.status == 429):
            early = [r for r in asked if paused.time + 1.0 < r.time < paused.time + self.spec.retry_after]
            if early:
                found.append(f"{self.spec.name}: {len(early)} requests within Retry-After "
                             f"{self.spec.retry_after}s of a 429")
        return found


_TCP_INFO_BYTES_ACKED = struct.Struct("@Q")  # struct tcp_info's tcpi_bytes_acked, at byte 120 (Linux 4.2+)


def _bytes_acked(sock: object) -> int:
    """The bytes of this connection the peer acknowledged so far; 0 once it is closed."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)  # type: ignore[attr-defined]
        return _TCP_INFO_BYTES_ACKED.unpack_from(info, 120)[0]
    except (OSError, AttributeError, struct.error):
        return 0


def busiest_second(times: list[float]) -> tuple[int, float]:
    """(most requests among sorted arrival ``times`` in any sliding one-second window
    [t, t + 1), where that window starts): what a site's own rate limiter would count."""
    best, at = 0, times[0] if times else 0.0
    for i, start in enumerate(times):
        count = bisect.bisect_left(times, start + 1.0, lo=i) - i
        if count > best:
            best, at = count, start
    return best, at


class SimWeb:
    """All sites on one event loop: ``await start()`` in a loop, or ``serving()`` in a thread."""

    def __init__(self, specs: list[SiteSpec], log_path: Path | None = None):
        self._log_file = open(log_path, "a", buffering=1) if log_path else None
        self.sites = {spec.name: Site(spec, self._log_file) for spec in specs}
        self._runners: list[web.AppRunner] = []

    async def start(self) -> None:
        for site in self.sites.values():
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", site.handle)
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await runner.setup()
            self._runners.append(runner)
            listener = stamped_listener(site.spec.host, site.spec.port)
            await web.SockSite(runner, listener).start()
            site.port = listener.getsockname()[1]

    async def stop(self) -> None:
        while self._runners:
            await self._runners.pop().cleanup()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    @contextmanager
    def serving(self) -> Iterator[SimWeb]:
        """Serve from a daemon thread with its own loop, so sync code and other loops can use it."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="simweb", daemon=True)
        thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.start(), loop).result(30)
            yield self
        finally:
            asyncio.run_coroutine_threadsafe(self.stop(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()

    def all_requests(self) -> list[RequestRecord]:
        return sorted((r for site in self.sites.values() for r in list(site.log)), key=lambda r: r.time)

    def write_sources(self, path: Path) -> Path:
        """The SOURCES_URL file: ``[{"source_name", "image_count"}]``."""
        listing = [{"source_name": s.spec.name, "image_count": s.spec.image_count}
                   for s in self.sites.values()]
        path.write_text(json.dumps(listing, indent=1))
        return path


# --- URL lists ----------------------------------------------------------------
@dataclass(frozen=True)
class Planned:
    """One scheduled URL and the outcome a correct crawler must give it."""

    uuid: str
    source: str       # as written in the TSV (the crawler lower-cases it)
    path: str
    expect: frozenset[str]  # a subset of demo.outcomes' kinds


def write_tsv(web_: SimWeb, plan: list[Planned], path: Path) -> Path:
    """The tsv_producer's input: columns url, identifier, source."""
    with open(path, "w", newline="") as out:
        writer = csv.writer(out, delimiter="\t", lineterminator="\n")
        writer.writerow(["url", "identifier", "source"])
        for item in plan:
            writer.writerow([web_.sites[item.source.lower()].url(item.path), item.uuid, item.source])
    return path


# --- Synthetic images ---------------------------------------------------------
FORMATS = (("jpg", 30), ("jpg", 50), ("jpg", 75), ("jpg", 90), ("jpg", 95),
           ("png", None), ("gif", None), ("webp", 80))
EXIF_ARTIST = 0x013B


def encode(image: Image.Image, ext: str, quality: int | None = None, artist: str | None = None) -> bytes:
    """``image`` in a web format; JPEGs get ``quality`` and, if given, an EXIF Artist tag."""
    buffer = io.BytesIO()
    if ext == "jpg":
        exif = Image.Exif()
        if artist:
            exif[EXIF_ARTIST] = artist
        image.convert("RGB").save(buffer, "JPEG", quality=quality, exif=exif.tobytes())
    elif ext == "gif":  # the fast encoder settings: fixtures are built on every run
        image.convert("RGB").quantize(256, method=Image.Quantize.FASTOCTREE).save(buffer, "GIF")
    elif ext == "webp":
        image.save(buffer, "WEBP", quality=quality or 80, method=0)
    else:
        image.save(buffer, "PNG", compress_level=1)
    return buffer.getvalue()


@cache
def synthetic_image(n: int) -> tuple[str, bytes, tuple[int, int]]:
    """Image ``n`` of a fixed family: (extension, bytes, (width, height)). Smooth noise, so
    JPEG quality means something, in sizes from thumbnail to larger than the target."""
    rng = np.random.default_rng(n)
    width, height = 40 + (n * 97) % 1100, 40 + (n * 61) % 800
    coarse = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)
    ext, quality = FORMATS[n % len(FORMATS)]
    return ext, encode(image, ext, quality, artist=f"simweb {n}" if n % 3 == 0 else None), (width, height)


BROKEN_BODIES = (b"", b"<html><body>Soft 404: no such image</body></html>", b"\x00" * 512,
                 b"GIF89a\x01\x00garbage")
SYNTHETIC_FAMILY = 48  # distinct images; URLs reuse them (bodies are shared, not copied)


# --- The standard test web ----------------------------------------------------
@dataclass(frozen=True)
class Behaviour:
    rate: float
    urls: int
    latency: float = 0.02
    error_rate: float = 0.0
    throttle_every: int = 0
    robots_txt: str | None = None


def standard_behaviours(n_sources: int, n_urls: int) -> list[Behaviour]:
    """Sources whose limits bind (1-10 req/s, few URLs) and big ones that take the rest;
    some with 500s, one with 429s, several with robots.txt rules, one with Crawl-delay.
    Every small source ends in under ~35 s at its limit, so the crawl's length is the
    workers' throughput, not a wait."""
    fixed = [
        Behaviour(rate=1, urls=25, latency=0.05, robots_txt=DISALLOW_PRIVATE),
        Behaviour(rate=2, urls=60, latency=0.1),
        Behaviour(rate=3, urls=90, robots_txt="User-agent: *\nDisallow: /\n\n"
                  "User-agent: cc-image-crawler\nDisallow: /private/\n"),
        Behaviour(rate=5, urls=120, error_rate=0.04),
        Behaviour(rate=10, urls=40, robots_txt=DISALLOW_PRIVATE + "Crawl-delay: 0.5\n"),
        Behaviour(rate=40, urls=150, throttle_every=50),
    ]
    behaviours = fixed[:n_sources]
    rest = n_sources - len(behaviours)
    left = n_urls - sum(b.urls for b in behaviours)
    for i in range(rest):
        share = left // (rest - i)
        left -= share
        behaviours.append(Behaviour(
            rate=20 + 180 * i / max(rest - 1, 1), urls=share, latency=0.01 * (i % 5),
            error_rate=0.03 if i % 7 == 3 else 0.0, robots_txt=DISALLOW_PRIVATE if i % 3 == 0 else None))
    return behaviours


def standard_web(n_sources: int, n_urls: int, prefix: str,
                 behaviours: list[Behaviour] | None = None) -> tuple[list[SiteSpec], list[Planned]]:
    """Sites named ``{prefix}{i:02d}`` and their URLs: ~88% images of every format, then
    404s, 410s, broken bodies and robots-disallowed paths, in a shuffled order."""
    behaviours = behaviours or standard_behaviours(n_sources, n_urls)
    specs, plan = [], []
    for i, b in enumerate(behaviours):
        name = f"{prefix}{i:02d}"
        disallows_private = b.robots_txt is not None and "Disallow: /private/" in b.robots_txt
        files: dict[str, bytes] = {}
        flaky = b.error_rate > 0 or b.throttle_every > 0
        for k in range(b.urls):
            kind = k % 25
            n = i * 1000 + k
            ext, body, _ = synthetic_image(n % SYNTHETIC_FAMILY)
            if kind == 1:
                path, expect = f"{MISSING}{n}.jpg", {LINK_ROT}
            elif kind == 2:
                path, expect = f"{GONE}{n}.png", {LINK_ROT}
            elif kind == 3:
                path, expect = f"{BROKEN}{n}.jpg", {CRAWL_ERRORS}
                files[path] = BROKEN_BODIES[n % len(BROKEN_BODIES)]
            elif kind == 4 and disallows_private:
                path, expect = f"{PRIVATE}{n}.{ext}", {OPTED_OUT}
                files[path] = body  # served if asked: only robots.txt keeps the crawler out
            else:
                path, expect = f"{IMAGE}{n}.{ext}", {QUALITY}
                files[path] = body
            if flaky and expect not in ({CRAWL_ERRORS}, {OPTED_OUT}):
                expect = expect | {CRAWL_ERRORS}  # a 500 or 429 on every attempt is an error
            shown = name.upper() if i == 1 else name  # the crawler must lower-case sources
            plan.append(Planned(str(uuidlib.uuid4()), shown, path, frozenset(expect)))
        specs.append(SiteSpec(name, image_count_for_rate(b.rate), files, latency=b.latency,
                              error_rate=b.error_rate, throttle_every=b.throttle_every,
                              robots_txt=b.robots_txt, seed=i))
    random.Random(n_urls).shuffle(plan)
    return specs, plan


def image_size(path: str) -> tuple[int, int] | None:
    """The real (width, height) a standard-web path serves, for checking quality messages."""
    if not path.startswith(IMAGE):
        return None
    return synthetic_image(int(path[len(IMAGE):].split(".")[0]) % SYNTHETIC_FAMILY)[2]


# --- Subprocess mode ------------------------------------------------------------
async def serve_until_signal(web_: SimWeb, plan: list[Planned], out_dir: Path) -> None:
    """Bind, write the files that need the ports, announce them, serve until SIGINT/SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await web_.start()
    try:
        web_.write_sources(out_dir / "sources.json")
        write_tsv(web_, plan, out_dir / "urls.tsv")
        print(json.dumps({"event": "simweb_ready",
                          "ports": {name: s.port for name, s in web_.sites.items()}}), flush=True)
        await stop.wait()
    finally:
        await web_.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--sources", type=int, default=20)
    parser.add_argument("--urls", type=int, default=2000)
    parser.add_argument("--prefix", default="sim")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    specs, plan = standard_web(args.sources, args.urls, args.prefix)
    web_ = SimWeb(specs, log_path=args.out_dir / "requests.jsonl")
    asyncio.run(serve_until_signal(web_, plan, args.out_dir))


if __name__ == "__main__":
    main()
