"""A website that remembers every request, to prove politeness from the side
that matters: what the site actually received, and when.

``python -m test.sites REDIS_URL N URL...`` is one crawler process: it waits
until N such processes have started (a Redis barrier, so they really race),
fetches every URL through a real gate, and prints the outcomes as JSON.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping
from urllib.parse import urljoin

from aiohttp import web

from worker.fetching.http_client import HttpClient
from worker.politeness import Refused, RequestGate

TEST_USER_AGENT = "polite-test-bot/1.0 (+http://127.0.0.1/about)"
_REDIRECTS = frozenset({301, 302, 303, 307, 308})



ROOT = Path(__file__).resolve().parent.parent


async def run_racing(module: str, argv_per_process: list[list[str]], timeout: float) -> list:
    """Run ``python -m module`` once per argument list, all at once (other crawler processes
    racing for the same Redis), and return what each printed as JSON on its last line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, *argv, cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE) for argv in argv_per_process]
    try:
        results = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), timeout)
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()
    outcomes = []
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err.decode()[-2000:]
        outcomes.append(json.loads(out.decode().strip().splitlines()[-1]))
    return outcomes


@dataclass
class Page:
    status: int = 200
    body: bytes | str = b"ok"
    headers: Mapping[str, str] = field(default_factory=dict)
    delay: float = 0.0  # seconds before answering, to keep a request in flight


@dataclass
class Hit:
    time: float  # wall-clock arrival
    path: str
    user_agent: str


class Site:
    """An aiohttp site on ``host`` (127.0.0.1, or another loopback address so that the per-host
    cap sees a host of its own) at a free port; other paths get ``default``."""

    def __init__(self, pages: Mapping[str, Page] | None = None, default: Page | None = None, port: int = 0,
                 host: str = "127.0.0.1"):
        self.port = port
        self.host = host
        self.pages = dict(pages or {})
        self.default = default or Page()
        self.hits: list[Hit] = []
        self.in_flight = self.max_in_flight = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _handle(self, request: web.Request) -> web.Response:
        self.hits.append(Hit(time.time(), request.path_qs, request.headers.get("User-Agent", "")))
        page = self.pages.get(request.path_qs, self.default)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(page.delay)
        finally:
            self.in_flight -= 1
        body = page.body.encode() if isinstance(page.body, str) else page.body
        return web.Response(status=page.status, body=body, headers=dict(page.headers))

    async def __aenter__(self) -> Site:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.url = f"http://{self.host}:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()

    def paths(self) -> list[str]:
        return [hit.path for hit in self.hits]

    def times(self, path_prefix: str) -> list[float]:
        return sorted(hit.time for hit in self.hits if hit.path.startswith(path_prefix))


async def fetch_politely(gate: RequestGate, client: HttpClient, url: str,
                         source: str, max_redirects: int = 5) -> int | str:
    """Drive the gate the way the worker's fetcher does; the final status or refusal reason."""
    for _ in range(max_redirects + 1):
        try:
            await gate.before_request(url, source)
        except Refused as refused:
            return refused.reason
        async with gate.host_slot(url):
            async with client.get(url) as response:
                await response.read_answer(1 << 20)
                status, headers = response.status, response.headers
        await gate.after_response(url, source, status, headers)
        if status not in _REDIRECTS:
            return status
        url = urljoin(url, headers["Location"])
    return "TooManyRedirects"


async def _crawler_process(redis_url: str, processes: int, urls: list[str]) -> None:
    import redis.asyncio as aioredis

    from common.settings import Settings
    from worker.politeness.gate import build_gate

    settings = Settings(redis_url=redis_url, crawl_user_agent=TEST_USER_AGENT,
                        crawl_allow_private_networks=True)
    redis = aioredis.from_url(redis_url, decode_responses=True)
    try:
        await redis.incr("test_barrier")
        deadline = time.monotonic() + 30
        while int(await redis.get("test_barrier")) < processes and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        client = HttpClient(TEST_USER_AGENT)
        try:
            gate = build_gate(settings, redis, client)
            outcomes = await asyncio.gather(*(fetch_politely(gate, client, u, "test") for u in urls))
        finally:
            await client.close()
        print(json.dumps(outcomes))
    finally:
        await redis.aclose()


if __name__ == "__main__":
    asyncio.run(_crawler_process(sys.argv[1], int(sys.argv[2]), sys.argv[3:]))
