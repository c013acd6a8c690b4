"""robots.txt: fetching edge cases (against a local site), rule matching, and the shared cache."""
from __future__ import annotations

import asyncio
import gzip
import socket

import pytest

from common.contracts import robots_key, robots_lock_key
from test.sites import TEST_USER_AGENT, Page, Site
from worker.fetching.http_client import HttpClient
from worker.politeness import Refused
from worker.politeness.addresses import AddressGuard
from worker.politeness.robots import (ALLOW_ALL, DISALLOW_ALL, DRAIN_BYTES, MAX_BYTES, RULES, ROBOTS_TTL,
                                      UNAVAILABLE, Backoff, RobotsCache, RobotsFile, Rules,
                                      fetch_robots, origin_of, product_token)
from worker.politeness.tdmrep import TDMREP_PATH, fetch_tdmrep

pytestmark = pytest.mark.paced  # runs by itself, after the rest (pytest.ini)

TOKEN = "polite-test-bot"
OPEN = AddressGuard(enabled=False)


@pytest.fixture
async def client():
    client = HttpClient(TEST_USER_AGENT)
    yield client
    await client.close()


@pytest.mark.parametrize("status, verdict", [
    (200, RULES), (204, RULES), (401, ALLOW_ALL), (403, ALLOW_ALL), (404, ALLOW_ALL),
    (410, ALLOW_ALL), (429, UNAVAILABLE), (500, UNAVAILABLE), (503, UNAVAILABLE),
])
async def test_status_decides_the_verdict(client, status, verdict):
    async with Site({"/robots.txt": Page(status, body="Disallow: /")}) as site:
        file = await fetch_robots(client, origin_of(site.url), OPEN)
    assert (file.verdict, file.status) == (verdict, status)
    assert site.hits[0].user_agent == TEST_USER_AGENT


async def test_network_error_is_unavailable(client):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed when the fetch runs: connection refused
    assert (await fetch_robots(client, f"http://127.0.0.1:{port}", OPEN)).verdict == UNAVAILABLE


async def test_forbidden_address_is_never_fetched(client):
    async with Site() as site:
        file = await fetch_robots(client, origin_of(site.url), AddressGuard(enabled=True))
    assert file.verdict == DISALLOW_ALL and site.hits == []


async def test_oversize_body_is_truncated_at_500_kib(client):
    head = "User-agent: *\nDisallow: /early\n"
    filler = "# " + "x" * 1000 + "\n"
    body = head + filler * 600 + "Disallow: /late\n"
    async with Site({"/robots.txt": Page(body=body)}) as site:
        file = await fetch_robots(client, origin_of(site.url), OPEN)
    assert len(file.body.encode()) <= MAX_BYTES and file.body.endswith("\n")
    rules = Rules(file, TOKEN)
    assert not rules.allowed(site.url + "/early") and rules.allowed(site.url + "/late")


@pytest.mark.parametrize("missing, kept", [(Page(404, body="<html>not here</html>"), 1),
                                           (Page(404, body="x" * (DRAIN_BYTES + 1)), 0)])
async def test_a_sites_rules_files_leave_their_connection_to_its_images(client, missing, kept):
    async with Site({"/robots.txt": Page(body="User-agent: *\nDisallow: /x\n"), TDMREP_PATH: missing}) as site:
        origin = origin_of(site.url)
        assert (await fetch_robots(client, origin, OPEN)).verdict == RULES
        assert (await fetch_tdmrep(client, origin, OPEN)).verdict == ALLOW_ALL
        assert client.idle_connections == kept  # a small 404 page read through; a long one closed


async def test_a_robots_txt_sent_gzipped_unasked_is_read(client):
    body = gzip.compress(b"User-agent: *\nDisallow: /x\n")
    async with Site({"/robots.txt": Page(body=body, headers={"Content-Encoding": "gzip"})}) as site:
        file = await fetch_robots(client, origin_of(site.url), OPEN)
    assert not Rules(file, TOKEN).allowed(site.url + "/x/1.jpg")


@pytest.mark.parametrize("hops, verdict", [(5, RULES), (6, ALLOW_ALL)])
async def test_redirect_chain(client, hops, verdict):
    async with Site() as target:
        target.pages["/final.txt"] = Page(body="User-agent: *\nDisallow: /x\n")
        async with Site() as site:
            pages = {"/robots.txt": "/r1"} | {f"/r{i}": f"/r{i + 1}" for i in range(1, hops - 1)}
            pages[f"/r{hops - 1}"] = target.url + "/final.txt"  # the last hop changes origin
            site.pages.update({p: Page(301, headers={"Location": loc}) for p, loc in pages.items()})
            file = await fetch_robots(client, origin_of(site.url), OPEN)
    assert file.verdict == verdict
    assert len(site.hits) == hops and len(target.hits) == (hops <= 5)


ROBOTS = """
User-agent: *
Disallow: /

User-agent: Polite-Test-Bot
Crawl-delay: 2.5
Disallow: /a
Allow: /a/b

User-agent: otherbot
Crawl-delay: 9
"""


def test_rules_match_our_product_token_only():
    assert product_token(TEST_USER_AGENT) == TOKEN
    ours = Rules(RobotsFile(RULES, ROBOTS), TOKEN)  # the group name matches case-insensitively
    assert [ours.allowed(f"http://h/{p}") for p in ("", "a", "a/c", "a/b", "a/b/c")] == \
        [True, False, False, True, True]
    assert ours.crawl_delay == 2.5
    stranger = Rules(RobotsFile(RULES, ROBOTS), "unknownbot")  # falls back to "*"
    assert not stranger.allowed("http://h/") and stranger.crawl_delay == 0


@pytest.mark.parametrize("line, delay", [("Crawl-delay: 3600", 60.0), ("Crawl-delay: soon", 0.0),
                                         ("Crawl-delay: -4", 0.0), ("", 0.0)])
def test_crawl_delay_is_sane(line, delay):
    assert Rules(RobotsFile(RULES, f"User-agent: *\n{line}\n"), TOKEN).crawl_delay == delay


def test_all_or_nothing_verdicts():
    assert Rules(RobotsFile(ALLOW_ALL), TOKEN).allowed("http://h/x")
    assert not Rules(RobotsFile(DISALLOW_ALL), TOKEN).allowed("http://h/x")


def test_origin_is_scheme_host_and_port():
    assert origin_of("https://Example.COM./a?b") == "https://example.com:443"
    assert origin_of("http://example.com:8080/") == "http://example.com:8080"
    assert origin_of("http://[2001:db8::1]/") == "http://[2001:db8::1]:80"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def counting_fetch(file: RobotsFile, pause: float = 0.0):
    calls = []

    async def fetch(origin: str) -> RobotsFile:
        calls.append(origin)
        await asyncio.sleep(pause)
        return file
    return fetch, calls


async def test_one_fetch_for_many_concurrent_urls_and_other_workers(redis_client):
    fetch, calls = counting_fetch(RobotsFile(RULES, "User-agent: *\nDisallow: /no\n"), 0.2)
    cache = RobotsCache(redis_client, fetch, TOKEN)
    urls = [f"http://h.example/{i}" for i in range(20)]
    await asyncio.gather(*(cache.check(u) for u in urls))
    with pytest.raises(Refused, match="RobotsDisallowed"):
        await cache.check("http://h.example/no/1")
    other_worker = RobotsCache(redis_client, fetch, TOKEN)
    await other_worker.check("http://h.example/again")
    assert calls == ["http://h.example:80"]
    key = robots_key("http://h.example:80")
    assert ROBOTS_TTL - 5 < await redis_client.ttl(key) <= ROBOTS_TTL
    assert await redis_client.get(robots_lock_key("http://h.example:80")) is None


async def test_unavailable_is_retried_with_backoff_and_never_disallows(redis_client):
    """503: the URL is refused as RobotsUnavailable with a retry time; the retries back off
    30 s, 60 s, ... up to an hour; once robots.txt answers, its rules decide."""
    wall, clock = Clock(), Clock()
    answers = [RobotsFile(UNAVAILABLE, status=503)] * 9 + [RobotsFile(RULES, "User-agent: *\nDisallow: /no\n")]
    calls = []

    async def fetch(origin: str) -> RobotsFile:
        calls.append(wall.now)
        return answers[len(calls) - 1]

    cache = RobotsCache(redis_client, fetch, TOKEN, clock=clock, wall=wall)
    waits = []
    for _ in range(9):
        with pytest.raises(Refused, match="RobotsUnavailable") as refused:
            await cache.check("https://down.example/x")
        waits.append(refused.value.retry_at - wall.now)
        with pytest.raises(Refused, match="RobotsUnavailable"):  # before it is due: no new fetch
            await cache.check("https://down.example/y")
        wall.now += waits[-1]
        clock.now += waits[-1]
    assert waits == [30, 60, 120, 240, 480, 960, 1920, 3600, 3600]
    assert len(calls) == 9
    await cache.check("https://down.example/x")
    with pytest.raises(Refused, match="RobotsDisallowed"):
        await cache.check("https://down.example/no")
    assert len(calls) == 10
    assert ROBOTS_TTL - 5 < await redis_client.ttl(robots_key("https://down.example:443")) <= ROBOTS_TTL


async def test_a_waiter_that_gives_up_defers_rather_than_disallows(redis_client, monkeypatch):
    monkeypatch.setattr("worker.politeness.robots.WAIT_SECONDS", 0.3)
    origin = "http://held.example:80"
    await redis_client.set(robots_lock_key(origin), "another-worker", ex=30)
    fetch, calls = counting_fetch(RobotsFile(ALLOW_ALL))
    with pytest.raises(Refused, match="RobotsUnavailable") as refused:
        await RobotsCache(redis_client, fetch, TOKEN, backoff=Backoff(5, 50)).check(origin + "/x")
    assert refused.value.retry_at is not None and calls == []


async def test_memory_cache_spares_redis_until_it_expires(redis_client):
    clock = Clock()
    fetch, calls = counting_fetch(RobotsFile(ALLOW_ALL))
    cache = RobotsCache(redis_client, fetch, TOKEN, clock=clock)
    await cache.check("http://m.example/1")
    await redis_client.flushdb()
    await cache.check("http://m.example/2")  # from memory
    assert len(calls) == 1
    clock.now += 3600
    await cache.check("http://m.example/3")
    assert len(calls) == 2


async def test_waits_for_the_worker_holding_the_lock(redis_client):
    origin = "http://busy.example:80"
    await redis_client.set(robots_lock_key(origin), "another-worker", ex=30)
    fetch, calls = counting_fetch(RobotsFile(ALLOW_ALL))
    waiting = asyncio.ensure_future(RobotsCache(redis_client, fetch, TOKEN).check(origin + "/x"))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await redis_client.set(robots_key(origin), RobotsFile(DISALLOW_ALL, status=500).to_json())
    with pytest.raises(Refused):
        await asyncio.wait_for(waiting, 5)
    assert calls == []


class SlowAfterFirstRead:
    """A Redis client whose first GET answers only after another worker has stored the file."""

    def __init__(self, redis, stored: asyncio.Event):
        self._redis, self._stored, self._first = redis, stored, True

    async def get(self, key):
        value = await self._redis.get(key)
        if self._first:
            self._first = False
            await self._stored.wait()
        return value

    def __getattr__(self, name):
        return getattr(self._redis, name)


async def test_a_worker_that_read_an_empty_cache_does_not_fetch_again(redis_client):
    """Worker B asks first (its reads slow), A at once: one of them fetches, the other waits for
    the stored file (the empty read and the lock are one script: no window between them)."""
    stored = asyncio.Event()
    fetch, calls = counting_fetch(RobotsFile(RULES, "User-agent: *\nDisallow: /no\n"))

    async def fetch_then_signal(origin: str) -> RobotsFile:
        file = await fetch(origin)
        asyncio.get_running_loop().call_later(0.05, stored.set)  # after A stored it and unlocked
        return file

    worker_a = RobotsCache(redis_client, fetch_then_signal, TOKEN)
    worker_b = RobotsCache(SlowAfterFirstRead(redis_client, stored), fetch, TOKEN)
    b_checking = asyncio.create_task(worker_b.check("http://race.example/b"))
    await asyncio.sleep(0.01)
    await worker_a.check("http://race.example/a")
    await b_checking
    assert calls == ["http://race.example:80"]


async def test_a_holder_whose_lock_expired_leaves_the_next_holders_lock(redis_client):
    """Worker A's fetch outlives its lock; B takes the lock; A's release must not delete B's."""
    origin = "http://slowlock.example:80"
    fetching = asyncio.Event()
    finish = asyncio.Event()

    async def slow_fetch(_origin: str) -> RobotsFile:
        fetching.set()
        await finish.wait()
        return RobotsFile(ALLOW_ALL)

    worker_a = asyncio.ensure_future(RobotsCache(redis_client, slow_fetch, TOKEN).check(origin + "/x"))
    await asyncio.wait_for(fetching.wait(), 5)
    await redis_client.set(robots_lock_key(origin), "worker-b-token", ex=100)  # A's expired, B's now
    finish.set()
    await asyncio.wait_for(worker_a, 5)
    assert await redis_client.get(robots_lock_key(origin)) == "worker-b-token"


async def test_an_unreadable_record_is_fetched_afresh_and_the_lock_released(redis_client):
    origin = "http://oldformat.example:80"
    await redis_client.set(robots_key(origin), "not a record of this version", ex=100)
    fetch, calls = counting_fetch(RobotsFile(RULES, "User-agent: *\nDisallow: /no\n"))
    cache = RobotsCache(redis_client, fetch, TOKEN)
    with pytest.raises(Refused, match="RobotsDisallowed"):
        await cache.check(origin + "/no/1")
    assert calls == [origin]
    assert RobotsFile.from_json(await redis_client.get(robots_key(origin))).verdict == RULES
    assert await redis_client.get(robots_lock_key(origin)) is None


async def test_a_fetch_that_fails_releases_the_lock(redis_client):
    origin = "http://broken.example:80"

    async def failing(_origin: str) -> RobotsFile:
        raise RuntimeError("a bug, not an answer")

    with pytest.raises(RuntimeError):
        await RobotsCache(redis_client, failing, TOKEN).check(origin + "/x")
    assert await redis_client.get(robots_lock_key(origin)) is None
    assert await redis_client.get(robots_key(origin)) is None


async def test_the_lock_outlives_the_longest_fetch(redis_client):
    """Six hops of FETCH_TIMEOUT each: the lock must not expire while the holder is still fetching."""
    from worker.politeness.robots import FETCH_TIMEOUT, MAX_REDIRECTS
    origin = "http://ttl.example:80"
    ttls = []

    async def fetch(_origin: str) -> RobotsFile:
        ttls.append(await redis_client.ttl(robots_lock_key(origin)))
        return RobotsFile(ALLOW_ALL)

    await RobotsCache(redis_client, fetch, TOKEN).check(origin + "/x")
    assert ttls and ttls[0] > (MAX_REDIRECTS + 1) * FETCH_TIMEOUT
