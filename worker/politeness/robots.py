"""robots.txt (RFC 9309), fetched once per origin per day for the whole cluster.

The fetched file is shared through Redis (``robots:{origin}``), so a site
sees one robots.txt request a day however many workers crawl it; a Redis lock
(``robots_lock:{origin}``) makes the first requests to a new origin wait for
a single fetch instead of each worker fetching it. Parsed rules are kept in
process memory briefly, so checking a URL costs no Redis round-trip.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from collections.abc import Awaitable, Callable
from urllib.parse import urljoin

import aiohttp
from protego import Protego
from redis.asyncio.lock import Lock
from redis.exceptions import LockError

from common.contracts import (EVENT_ROBOTS_FETCHED, robots_key,
                              robots_lock_key)
from common.hosts import url_origin
from common.jsonlog import log_event
from common.statuses import Status
from common.protocols import AsyncRedis
from worker.politeness import Refused
from worker.politeness.addresses import AddressGuard
from worker.politeness.ttl_cache import TtlCache

ROBOTS_TTL = 24 * 3600            # RFC 9309: cache no longer than 24 hours
UNREACHABLE_TTL = 10 * 60         # 5xx / network error: disallow all, retry soon
MAX_BYTES = 500 * 1024            # RFC 9309: parse at least 500 KiB; we read no more
MAX_REDIRECTS = 5                 # RFC 9309: follow at least five
FETCH_TIMEOUT = 20.0              # per hop
# The whole fetch, every hop together, is cut off here; the lock outlives it (and the Redis
# write after it), so a live holder never loses its lock to a second fetcher.
FETCH_DEADLINE = (MAX_REDIRECTS + 1) * FETCH_TIMEOUT
LOCK_SECONDS = FETCH_DEADLINE + 30
POLL_SECONDS = 0.1
WAIT_SECONDS = 60.0               # a dead holder's lock expires, then a waiter fetches
MEMORY_SECONDS = 120.0
MAX_CRAWL_DELAY = 60.0            # one request a minute is the slowest we go
_REDIRECTS = frozenset({301, 302, 303, 307, 308})

RULES, ALLOW_ALL, DISALLOW_ALL = "rules", "allow_all", "disallow_all"


def product_token(user_agent: str) -> str:
    """The name robots.txt groups address us by: ``cc-image-crawler`` in ``cc-image-crawler/1.0 (...)``."""
    return user_agent.split()[0].split("/")[0]


def origin_of(url: str) -> str:
    """scheme://host:port, the unit robots.txt applies to (RFC 9309 section 2.3), with the
    host as every other layer reads it (InvalidHost, a ValueError, if it does not normalise)."""
    origin = url_origin(url)
    return f"{origin.scheme}://{origin.netloc}"


@dataclass(frozen=True)
class RobotsFile:
    """What fetching robots.txt told us; the form shared through Redis."""

    verdict: str          # RULES, ALLOW_ALL or DISALLOW_ALL
    body: str = ""
    status: int | None = None

    @property
    def ttl(self) -> int:
        return UNREACHABLE_TTL if self.verdict == DISALLOW_ALL else ROBOTS_TTL

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> RobotsFile:
        return cls(**json.loads(raw))


class Rules:
    """A RobotsFile read for one product token."""

    def __init__(self, file: RobotsFile, token: str):
        self.verdict = file.verdict
        self._token = token
        self._parser = Protego.parse(file.body) if file.verdict == RULES else None

    def allowed(self, url: str) -> bool:
        if self._parser is None:
            return self.verdict == ALLOW_ALL
        return self._parser.can_fetch(url, self._token)

    @property
    def crawl_delay(self) -> float:
        delay = self._parser.crawl_delay(self._token) if self._parser else None
        return min(max(float(delay or 0), 0.0), MAX_CRAWL_DELAY)


async def _read_capped(response: aiohttp.ClientResponse) -> str:
    data = bytearray()
    async for chunk in response.content.iter_chunked(64 * 1024):
        data += chunk
        if len(data) >= MAX_BYTES:
            # Drop the cut-off last line: half a rule could mean something else.
            data = data[:MAX_BYTES]
            data = data[:data.rfind(b"\n") + 1]
            break
    return data.decode("utf-8-sig", errors="replace")


async def fetch_robots(session: aiohttp.ClientSession, origin: str,
                       guard: AddressGuard) -> RobotsFile:
    """Fetch origin's robots.txt, checking every redirect hop with the address guard."""
    url = f"{origin}/robots.txt"
    timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT)
    try:
        for _ in range(MAX_REDIRECTS + 1):
            await guard.check(url)
            async with session.get(url, allow_redirects=False, timeout=timeout) as response:
                status = response.status
                if status in _REDIRECTS and "Location" in response.headers:
                    url = urljoin(url, response.headers["Location"])
                    continue
                if 200 <= status < 300:
                    return RobotsFile(RULES, await _read_capped(response), status)
                if status == 429 or status >= 500:
                    return RobotsFile(DISALLOW_ALL, status=status)
                return RobotsFile(ALLOW_ALL, status=status)  # 4xx: no rules for us
        return RobotsFile(ALLOW_ALL)  # RFC 9309: too many redirects means unavailable
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError, Refused):
        return RobotsFile(DISALLOW_ALL)  # unreachable: assume complete disallow


async def _release(lock: Lock) -> None:
    try:
        await lock.release()
    except LockError:
        pass  # expired, perhaps taken by another worker since: theirs now, left alone


class RobotsCache:
    """Rules per origin: process memory, then Redis, then one fetch for the cluster."""

    def __init__(self, redis: AsyncRedis, fetch: Callable[[str], Awaitable[RobotsFile]], token: str,
                 clock: Callable[[], float] = time.monotonic):
        self._redis = redis
        self._fetch = fetch
        self._token = token
        self._clock = clock
        self._memory: TtlCache[str, Rules] = TtlCache(clock)
        self._loading: dict[str, asyncio.Future[Rules]] = {}

    async def check(self, url: str) -> None:
        if not (await self.rules(origin_of(url))).allowed(url):
            raise Refused(Status.ROBOTS_DISALLOWED, url)

    async def rules(self, origin: str) -> Rules:
        rules = self._memory.get(origin)
        if rules is not None:
            return rules
        loading = self._loading.get(origin)
        if loading is None:  # one load per origin per process, however many URLs wait
            loading = asyncio.ensure_future(self._load(origin))
            self._loading[origin] = loading
            loading.add_done_callback(lambda _: self._loading.pop(origin, None))
        return await asyncio.shield(loading)

    async def _load(self, origin: str) -> Rules:
        file, ttl = await self._shared_file(origin)
        rules = Rules(file, self._token)
        self._memory.put(origin, rules, min(ttl, MEMORY_SECONDS))
        return rules

    async def _fetch_within_deadline(self, origin: str) -> RobotsFile:
        try:
            async with asyncio.timeout(FETCH_DEADLINE):
                return await self._fetch(origin)
        except TimeoutError:
            return RobotsFile(DISALLOW_ALL)  # unreachable in time

    async def _shared_file(self, origin: str) -> tuple[RobotsFile, float]:
        deadline = self._clock() + WAIT_SECONDS
        while True:
            raw = await self._redis.get(robots_key(origin))
            if raw is not None:
                return RobotsFile.from_json(raw), MEMORY_SECONDS
            # Token-checked: released only if still ours, so a holder whose lock expired
            # never deletes the lock a second fetcher has taken since.
            lock = Lock(self._redis, robots_lock_key(origin), timeout=LOCK_SECONDS,  # type: ignore[arg-type]
                        blocking=False, thread_local=False)
            if await lock.acquire():
                try:
                    # Another worker may have stored the file between our read and our lock.
                    raw = await self._redis.get(robots_key(origin))
                    if raw is not None:
                        return RobotsFile.from_json(raw), MEMORY_SECONDS
                    file = await self._fetch_within_deadline(origin)
                    await self._redis.set(robots_key(origin), file.to_json(), ex=file.ttl)
                finally:
                    await _release(lock)
                log_event(EVENT_ROBOTS_FETCHED, origin=origin, verdict=file.verdict,
                          status=file.status, bytes=len(file.body))
                return file, MEMORY_SECONDS
            if self._clock() >= deadline:
                # Nobody could fetch it in time: refuse for now, decide again next URL.
                return RobotsFile(DISALLOW_ALL), 0
            await asyncio.sleep(POLL_SECONDS)
