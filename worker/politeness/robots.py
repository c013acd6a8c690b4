"""robots.txt (RFC 9309), fetched once per origin per day for the whole cluster.

The fetched file is shared through Redis (``robots:{origin}``), so a site
sees one robots.txt request a day however many workers crawl it; a Redis lock
(``robots_lock:{origin}``) makes the first requests to a new origin wait for
a single fetch instead of each worker fetching it (token-checked, and longer
than the longest fetch). Redis keeps only the group that applies to our
product token (``robots_group``), so a 500 KiB file costs the cluster little.
Parsed rules are kept in process memory briefly, within a byte budget, so
checking a URL costs no Redis round-trip.

A robots.txt that cannot be had (5xx, 429, timeout, no connection) is tried
again with backoff (30 s doubling to 1 h); meanwhile its URLs are refused
with ``RobotsUnavailable`` and a ``retry_at``, which the task turns into a
wait (``worker.parking.wait_topics``), not an outcome. A 4xx means no rules (RFC 9309).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from collections.abc import Awaitable, Callable
from urllib.parse import urljoin

from protego import Protego

from common.contracts import (EVENT_ROBOTS_FETCHED, SIGNAL_ROBOTS, SIGNAL_ROBOTS_CONTENT_USAGE,
                              SIGNAL_ROBOTS_EXTRA, robots_key, robots_lock_key)
from common.hosts import url_origin
from common.jsonlog import log_event
from common.statuses import Status
from common.protocols import AsyncRedis
from worker.fetching.http_client import BadResponse, Disconnected, HttpClient, Response
from worker.politeness import Refused
from worker.politeness.addresses import AddressGuard
from worker.politeness.consent import Decision, usage_refusal
from worker.politeness.path_pattern import LongestMatch, url_path
from worker.politeness.robots_group import CONTENT_USAGE_DIRECTIVE, GroupTooLarge, groups_for
from worker.politeness.single_flight import SingleFlight
from worker.politeness.ttl_cache import TtlCache

ROBOTS_TTL = 24 * 3600            # RFC 9309: cache no longer than 24 hours
MAX_BYTES = 500 * 1024            # RFC 9309: parse at least 500 KiB; we read no more
MAX_REDIRECTS = 5                 # RFC 9309: follow at least five
FETCH_TIMEOUT = 20.0              # per hop
DRAIN_BYTES = 64 * 1024           # a non-2xx answer's body read to keep its connection, at most
DRAIN_SECONDS = 2.0               # and for at most this long
# The whole fetch, every hop together, is cut off here; the lock outlives it (and the Redis
# write after it), so a live holder never loses its lock to a second fetcher.
FETCH_DEADLINE = (MAX_REDIRECTS + 1) * FETCH_TIMEOUT
LOCK_SECONDS = FETCH_DEADLINE + 30
LOCK_MS = int(LOCK_SECONDS * 1000)
POLL_SECONDS = 0.1
WAIT_SECONDS = 60.0               # a dead holder's lock expires, then a waiter fetches
MEMORY_SECONDS = 120.0
MEMORY_BYTES = 64 << 20           # parsed rules kept per worker (ROBOTS_CACHE_BYTES)
# A parsed group's memory: a base and a share a character of rules (docs/decisions.md, "robots.txt").
RULES_BASE_BYTES = 4096
RULES_BYTES_PER_CHAR = 32
MAX_CRAWL_DELAY = 60.0            # one request a minute is the slowest we go
_REDIRECTS = frozenset({301, 302, 303, 307, 308})

# UNAVAILABLE: 5xx, 429, a timeout or no connection (RFC 9309 "unreachable"): the site's
# URLs wait (Refused with retry_at) until it can be fetched, never end as disallowed.
RULES, ALLOW_ALL, DISALLOW_ALL, UNAVAILABLE = "rules", "allow_all", "disallow_all", "unavailable"


def product_token(user_agent: str) -> str:
    """The name robots.txt groups address us by: ``cc-image-crawler`` in ``cc-image-crawler/1.0 (...)``."""
    return user_agent.split()[0].split("/")[0]


def origin_of(url: str) -> str:
    """scheme://host:port, the unit robots.txt applies to (RFC 9309 section 2.3), with the
    host as every other layer reads it (InvalidHost, a ValueError, if it does not normalise)."""
    origin = url_origin(url)
    return f"{origin.scheme}://{origin.netloc}"


@dataclass(frozen=True)
class Backoff:
    """When an unavailable robots.txt is tried again: ``first`` seconds after the first
    failure, doubling with each failure in a row, at most ``most``."""

    first: float = 30.0
    most: float = 3600.0

    def after(self, failures: int) -> float:
        return min(self.first * 2.0 ** min(max(failures, 1) - 1, 32), self.most)


@dataclass(frozen=True)
class RobotsFile:
    """What fetching robots.txt told us; the form shared through Redis, where ``body`` holds
    only the group our product token selects (``robots_group``)."""

    verdict: str          # RULES, ALLOW_ALL, DISALLOW_ALL or UNAVAILABLE
    body: str = ""
    status: int | None = None
    failures: int = 0     # UNAVAILABLE: fetches failed in a row
    retry_at: float = 0.0 # UNAVAILABLE: Unix time from which it is fetched again
    # RULES: the group of each of ROBOTS_EXTRA_TOKENS (``body`` is ours), and every token the
    # record was condensed for: a record kept for other tokens (or by an older version, which
    # dropped Content-Usage lines) is fetched afresh.
    groups: dict[str, str] = field(default_factory=dict)
    tokens: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> RobotsFile:
        return cls(**json.loads(raw))


class Rules:
    """A RobotsFile read for our product token and the extra ones: the strictest group wins.
    ``categories``: the AI-preference categories of our use (Content-Usage rules); () ignores them."""

    def __init__(self, file: RobotsFile, token: str, extra_tokens: tuple[str, ...] = (),
                 categories: tuple[str, ...] = ()):
        self.verdict = file.verdict
        self.retry_at = file.retry_at
        self.status = file.status
        self._token = token
        self._parser = Protego.parse(file.body) if file.verdict == RULES else None
        self._extra: list[tuple[str, str, Protego]] = []  # (token, its group's user-agent, parser)
        self._usage: list[LongestMatch] = []
        bodies = [file.body]
        if file.verdict == RULES:
            for extra in extra_tokens:
                body = file.groups.get(extra, "")
                if body:
                    self._extra.append((extra, _agent_of(body), Protego.parse(body)))
                    bodies.append(body)
            if categories:
                for body in dict.fromkeys(bodies):
                    usage = _usage_rules(body, categories)
                    if usage:
                        self._usage.append(usage)
        # What the parsed rules cost a worker's memory (RULES_BYTES_PER_CHAR).
        self.size = RULES_BASE_BYTES + RULES_BYTES_PER_CHAR * sum(len(b) for b in bodies)
        self._agent = _agent_of(file.body)

    def allowed(self, url: str) -> bool:
        return self.refusal(url) is None

    def refusal(self, url: str) -> Decision | None:
        """Why ``url`` must not be requested, or None: our group, then each extra token's, then
        the Content-Usage rules of them all (the most restrictive statement wins)."""
        if self._parser is None:
            if self.verdict == ALLOW_ALL:
                return None
            return Decision(SIGNAL_ROBOTS, f"{self.verdict} (robots.txt status {self.status})")
        if not self._parser.can_fetch(url, self._token):
            return Decision(SIGNAL_ROBOTS, f"User-agent: {self._agent}: {url_path(url)[:200]} disallowed")
        for token, agent, parser in self._extra:
            if not parser.can_fetch(url, token):
                return Decision(SIGNAL_ROBOTS_EXTRA, f"{token} (User-agent: {agent}): "
                                                     f"{url_path(url)[:200]} disallowed")
        if self._usage:
            path = url_path(url)
            for usage in self._usage:
                rule = usage.best(path)
                if rule is not None:
                    return Decision(SIGNAL_ROBOTS_CONTENT_USAGE, rule)
        return None

    @property
    def crawl_delay(self) -> float:
        delays = [self._parser.crawl_delay(self._token) if self._parser else None]
        delays += [parser.crawl_delay(token) for token, _, parser in self._extra]
        return min(max(max(float(d or 0) for d in delays), 0.0), MAX_CRAWL_DELAY)


def _agent_of(group: str) -> str:
    """The user-agent name a condensed group (``robots_group``) was chosen by."""
    first = group.partition("\n")[0]
    return first.partition(":")[2].strip() or "*"


def _usage_rules(group: str, categories: tuple[str, ...]) -> LongestMatch | None:
    """The group's Content-Usage rules that disallow one of ``categories``, by path: a rule that
    allows still counts, as the longest match it is (a later ``/a/b train-ai=y`` under
    ``/a train-ai=n`` allows ``/a/b``); a match with no refusal maps to None."""
    rules: list[tuple[str, str]] = []
    refusing = False
    for line in group.splitlines()[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() != CONTENT_USAGE_DIRECTIVE:
            continue
        value = value.strip()
        path, space, statement = value.partition(" ")
        if not space or not path.startswith("/"):
            path, statement = "", value  # no path: the rule covers every path
        refused = usage_refusal(statement.strip(), categories)
        refusing = refusing or refused is not None
        rules.append((path, f"{path or '/'} {statement.strip()}" if refused else ""))
    if not refusing:
        return None
    return _NonEmpty(rules)


class _NonEmpty(LongestMatch):
    """A LongestMatch whose empty values (rules that do not refuse) read as None."""

    def best(self, path: str) -> str | None:
        return super().best(path) or None


def _capped(data: bytes) -> str:
    if len(data) >= MAX_BYTES:  # cut off: drop the last line, half a rule could mean something else
        data = data[:data.rfind(b"\n") + 1]
    return data.decode("utf-8-sig", errors="replace")


async def fetch_robots(client: HttpClient, origin: str, guard: AddressGuard) -> RobotsFile:
    """Fetch origin's robots.txt, checking every redirect hop with the address guard."""
    return await fetch_origin_file(client, f"{origin}/robots.txt", guard, MAX_BYTES, _rules)


def _rules(data: bytes, status: int) -> RobotsFile:
    return RobotsFile(RULES, _capped(data), status)


async def fetch_origin_file(client: HttpClient, url: str, guard: AddressGuard, limit: int,
                            answer: Callable[[bytes, int], RobotsFile]) -> RobotsFile:
    """GET a per-origin rules file (robots.txt, tdmrep.json) on the image client, so the site's
    first image reuses its connection; every redirect hop checked by the address guard: a 2xx's
    first ``limit`` bytes are ``answer``'s to read, a 429 or 5xx unavailable, any other status or
    too many redirects no file (RFC 9309: "unavailable" as a 4xx)."""
    try:
        for _ in range(MAX_REDIRECTS + 1):
            await guard.check(url)
            async with asyncio.timeout(FETCH_TIMEOUT), client.get(url) as response:
                status = response.status
                if 200 <= status < 300:
                    return answer(await response.read_prefix(limit), status)
                await _drain(response)  # a small 404 page: the connection stays fit for the images
                if status in _REDIRECTS and "Location" in response.headers:
                    url = urljoin(url, response.headers["Location"])
                    continue
                if status == 429 or status >= 500:
                    return RobotsFile(UNAVAILABLE, status=status)
                return RobotsFile(ALLOW_ALL, status=status)  # 4xx: no file, no rules for us
        return RobotsFile(ALLOW_ALL)  # too many redirects
    except Refused:
        return RobotsFile(DISALLOW_ALL)  # a hop we must not reach: no answer will come
    except (TimeoutError, OSError, BadResponse, Disconnected):
        return RobotsFile(UNAVAILABLE)  # unreachable or garbled: wait, and try again later
    except ValueError:  # a hop whose URL has no host that normalises, or cannot be sent
        return RobotsFile(DISALLOW_ALL)


async def _drain(response: Response) -> None:
    """A small body read to its end keeps the connection; a long or slow one closes it."""
    with contextlib.suppress(BadResponse, Disconnected, OSError, TimeoutError):
        async with asyncio.timeout(DRAIN_SECONDS):
            await response.read_prefix(DRAIN_BYTES)


# A file kept in Redis, or the lock to fetch it when there is none, in one round trip
# (KEYS: the file, its lock; ARGV: our token, the lock's ms): {file or nil, 1 if locked}.
READ_OR_LOCK = """
local file = redis.call('GET', KEYS[1])
if file then return {file, 0} end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return {false, 1} end
return {false, 0}
"""
# The fetched file stored, and the lock released only if it is still ours: a holder whose lock
# expired leaves the next holder's (KEYS: the file, its lock; ARGV: the file, its s, our token).
STORE_AND_UNLOCK = """
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
if redis.call('GET', KEYS[2]) == ARGV[3] then redis.call('DEL', KEYS[2]) end
return 1
"""
UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _parsed(raw: str | bytes | None) -> RobotsFile | None:
    if raw is None:
        return None
    try:
        return RobotsFile.from_json(raw)
    except (ValueError, TypeError):  # another version's record: fetched afresh
        return None


class RobotsCache:
    """Rules per origin: process memory, then Redis, then one fetch for the cluster.
    ``extra_tokens`` (ROBOTS_EXTRA_TOKENS) bind us as our own token does; ``categories``: the
    AI-preference categories whose Content-Usage refusal keeps us out (empty: not read)."""

    key = staticmethod(robots_key)
    lock_key = staticmethod(robots_lock_key)
    event = EVENT_ROBOTS_FETCHED
    unavailable_status = Status.ROBOTS_UNAVAILABLE
    refused_status = Status.ROBOTS_DISALLOWED

    def __init__(self, redis: AsyncRedis, fetch: Callable[[str], Awaitable[RobotsFile]], token: str,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 backoff: Backoff = Backoff(), memory_bytes: int = MEMORY_BYTES,
                 extra_tokens: tuple[str, ...] = (), categories: tuple[str, ...] = ()):
        self._redis = redis
        self._fetch = fetch
        self._token = token
        self._extra_tokens = tuple(t for t in dict.fromkeys(extra_tokens) if t.lower() != token.lower())
        self._categories = categories
        self._clock = clock
        self._wall = wall  # Unix time: retry times are shared by the cluster
        self._backoff = backoff
        self._memory: TtlCache[str, Rules] = TtlCache(clock, max_bytes=memory_bytes)
        self._loading: SingleFlight[str, Rules] = SingleFlight()
        self._read_or_lock = redis.register_script(READ_OR_LOCK)
        self._store_and_unlock = redis.register_script(STORE_AND_UNLOCK)
        self._unlock = redis.register_script(UNLOCK)

    async def check(self, url: str, origin: str | None = None) -> None:
        """Refused if ``url`` (of ``origin``, if the caller has it) must not be requested."""
        rules = await self.rules(origin_of(url) if origin is None else origin)
        if rules.verdict == UNAVAILABLE:
            raise Refused(self.unavailable_status, url, retry_at=rules.retry_at)
        decision = rules.refusal(url)
        if decision is not None:
            status = Status.OPTED_OUT if decision.signal == SIGNAL_ROBOTS_CONTENT_USAGE else self.refused_status
            raise Refused(status, url, decision=decision)

    async def rules(self, origin: str) -> Rules:
        rules = self._memory.get(origin)
        if rules is not None:
            return rules
        # One load per origin per process, however many URLs wait.
        return await self._loading.run(origin, lambda: self._load(origin))

    def memory_held(self) -> tuple[int, int]:
        """The origins whose rules this process holds, and their bytes (within ``memory_bytes``)."""
        return len(self._memory), self._memory.nbytes

    def remembers(self, origin: str) -> bool:
        """Whether ``origin``'s rules are held in this process's memory (unexpired)."""
        return self._memory.get(origin) is not None

    def _compile(self, file: RobotsFile) -> Rules:
        return Rules(file, self._token, self._extra_tokens, self._categories)

    async def _load(self, origin: str) -> Rules:
        file = await self._shared_file(origin)
        rules = self._compile(file)
        ttl = MEMORY_SECONDS
        if file.verdict == UNAVAILABLE:  # remembered until it is due again, not past
            ttl = min(ttl, file.retry_at - self._wall())
        self._memory.put(origin, rules, ttl, rules.size)
        return rules

    def _tokens(self) -> list[str]:
        return [self._token, *self._extra_tokens]

    def _current(self, file: RobotsFile | None) -> bool:
        if file is None:
            return False
        if file.verdict == UNAVAILABLE:
            return file.retry_at > self._wall()
        return file.verdict != RULES or file.tokens == self._tokens()

    async def _shared_file(self, origin: str) -> RobotsFile:
        """The origin's file from Redis, or fetched by this worker under the origin's lock (one
        fetch for the cluster; the others poll until it is stored)."""
        deadline = self._clock() + WAIT_SECONDS
        keys = [self.key(origin), self.lock_key(origin)]
        token = uuid.uuid4().hex  # the lock is released only by its holder
        while True:
            raw, locked = await self._read_or_lock(keys=keys, args=[token, LOCK_MS])
            stored = _parsed(raw)
            if stored is not None and self._current(stored):
                return stored
            if raw is not None and await self._redis.set(keys[1], token, nx=True, px=LOCK_MS):
                # Out of date or unreadable: fetched again, unless another worker did in between.
                locked, stored = True, await self._stored(origin)
                if stored is not None and self._current(stored):
                    await self._unlock(keys=keys[1:], args=[token])
                    return stored
            if locked:
                return await self._fetch_and_store(origin, stored, token)
            if self._clock() >= deadline:
                # Nobody could fetch it in time: the URL waits, and asks again later.
                return RobotsFile(UNAVAILABLE, retry_at=self._wall() + self._backoff.first)
            await asyncio.sleep(POLL_SECONDS)

    async def _stored(self, origin: str) -> RobotsFile | None:
        return _parsed(await self._redis.get(self.key(origin)))

    def _condense(self, file: RobotsFile) -> RobotsFile:
        """The record kept in Redis for a fetched RULES file: only the groups that bind us."""
        try:
            groups = groups_for(file.body, tuple(self._tokens()))
        except GroupTooLarge:
            # Rules for us alone longer than any real site's: hostile or broken, and
            # cutting them could allow what they forbid. Nothing is crawled for a day.
            return RobotsFile(DISALLOW_ALL, status=file.status)
        return replace(file, body=groups[self._token], tokens=self._tokens(),
                       groups={t: groups[t] for t in self._extra_tokens if groups[t]})

    async def _fetch_and_store(self, origin: str, previous: RobotsFile | None, token: str) -> RobotsFile:
        """Fetch under the lock ``token`` holds; store the file and release the lock in one call
        (released alone if anything fails first)."""
        keys = [self.key(origin), self.lock_key(origin)]
        stored = False
        try:
            file = await self._fetch_within_deadline(origin)
            fetched_bytes = len(file.body)
            ttl = float(ROBOTS_TTL)
            if file.verdict == RULES:
                file = self._condense(file)
            elif file.verdict == UNAVAILABLE:
                failures = (previous.failures if previous and previous.verdict == UNAVAILABLE else 0) + 1
                wait = self._backoff.after(failures)
                file = replace(file, failures=failures, retry_at=self._wall() + wait)
                ttl = wait + self._backoff.most  # the count of failures outlives the wait
            record = file.to_json()
            await self._store_and_unlock(keys=keys, args=[record, max(1, math.ceil(ttl)), token])
            stored = True
        finally:
            if not stored:
                await self._unlock(keys=keys[1:], args=[token])
        log_event(self.event, origin=origin, verdict=file.verdict, status=file.status,
                  bytes=fetched_bytes, stored_bytes=len(record), failures=file.failures)
        return file

    async def _fetch_within_deadline(self, origin: str) -> RobotsFile:
        try:
            async with asyncio.timeout(FETCH_DEADLINE):
                return await self._fetch(origin)
        except TimeoutError:
            return RobotsFile(UNAVAILABLE)  # not reachable in time
