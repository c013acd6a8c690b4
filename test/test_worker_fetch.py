"""The rate-limited fetcher against a local aiohttp site: tokens, gate, redirects, caps."""
from __future__ import annotations

import asyncio
import math
import time
import json
import socket
from itertools import pairwise
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from common.contracts import rate_limit_key, send_pace_key, sent_log_key, source_requests_key, tokens_key
from test.worker_fakes import AllowAllGate, FakeRedis, LoopbackResolver
from worker.fetching.fetch import FetchError, Fetcher
from worker.fetching.http_client import HttpClient
from worker.politeness.consent import ResponseConsent
from worker.politeness.addresses import GuardedResolver
from common.contracts import allowed_per_second
from demo.simweb import busiest_second
from worker.constants import (PACE_CATCH_UP_SECONDS, STALE_TOKEN_SECONDS, TOKEN_PEEK_INTERVAL, TOKEN_TURN_RATE,
                              TOKENS_FORGET_CHECK_SECONDS, TOKENS_FORGET_SECONDS)
from worker.fetching.tokens import PACED_DECR, ShuttingDown, TokenBuckets
from worker.monitor_view import MonitorView

pytestmark = pytest.mark.paced  # runs by itself, after the rest (pytest.ini)

SOURCE = "example"
BODY = b"\x89PNG" + b"x" * 1000
USER_AGENT = "cc-image-crawler/1.0 (+https://example.org/bot)"
USER_AGENTS = web.AppKey("user_agents", list)


def respond(**kwargs):
    async def handler(_request: web.Request) -> web.Response:
        return web.Response(**kwargs)
    return handler


def site() -> web.Application:
    app = web.Application()
    seen = app[USER_AGENTS] = []

    async def image(request: web.Request) -> web.Response:
        seen.append(request.headers.get("User-Agent"))
        return web.Response(body=BODY, content_type="image/png")

    async def hop(request: web.Request) -> web.Response:
        n = int(request.match_info["n"])
        raise web.HTTPFound("/image" if n == 0 else f"/hop/{n - 1}")

    async def huge(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()  # chunked: no Content-Length to refuse early
        await response.prepare(request)
        for _ in range(100):
            await response.write(b"x" * 10_000)
        return response

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response(body=BODY)

    async def cut(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Length": "10000"})
        await response.prepare(request)
        await response.write(b"x" * 100)
        request.transport.close()
        return response

    app.router.add_get("/image", image)
    app.router.add_get("/hop/{n}", hop)
    app.router.add_get("/huge", huge)
    app.router.add_get("/declared-huge", respond(body=b"x" * 20_000))
    app.router.add_get("/slow", slow)
    app.router.add_get("/cut", cut)
    app.router.add_get("/evil-redirect", respond(status=302, headers={"Location": "ftp://x/y"}))
    app.router.add_get("/missing", respond(status=404, text="gone"))
    app.router.add_get("/noai", respond(body=b"x" * 40_000, headers={"X-Robots-Tag": "noai"}))
    app.router.add_get("/reserved", respond(body=b"x" * 40_000, headers={"tdm-reservation": "1"}))
    return app


@pytest.fixture
async def server():
    server = TestServer(site(), host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


@pytest.fixture
async def http():
    client = HttpClient(USER_AGENT)
    yield client
    await client.close()


def make_fetcher(http, redis, gate=None, max_bytes: int = 50_000, total_timeout: float = 90.0) -> Fetcher:
    return Fetcher(http, gate or AllowAllGate(), TokenBuckets(redis), max_bytes, total_timeout)


async def test_image_is_downloaded_with_a_token_and_our_user_agent(server, http) -> None:
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 10)
    fetched = await make_fetcher(http, redis).fetch(str(server.make_url("/image")), SOURCE)
    assert (fetched.status, fetched.body.bytes()) == (200, BODY)
    assert server.app[USER_AGENTS] == [USER_AGENT]
    assert redis.integer(tokens_key(SOURCE)) == 9
    assert redis.integer(source_requests_key(SOURCE)) == 1


async def test_each_redirect_hop_asks_the_gate_and_takes_a_token(server, http) -> None:
    redis, gate = FakeRedis(), AllowAllGate()
    await redis.set(tokens_key(SOURCE), 10)
    fetched = await make_fetcher(http, redis, gate).fetch(str(server.make_url("/hop/2")), SOURCE)
    assert fetched.status == 200 and fetched.url.endswith("/image")
    assert redis.integer(tokens_key(SOURCE)) == 6 and redis.integer(source_requests_key(SOURCE)) == 4
    kinds = [kind for kind, _url in gate.calls]
    assert kinds == ["before_request", "host_slot", "after_response"] * 4


async def test_more_than_five_redirects_is_an_error(server, http) -> None:
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 100)
    assert (await make_fetcher(http, redis).fetch(str(server.make_url("/hop/4")), SOURCE)).status == 200
    with pytest.raises(FetchError) as info:
        await make_fetcher(http, redis).fetch(str(server.make_url("/hop/5")), SOURCE)
    assert (info.value.status, info.value.http_status) == ("TooManyRedirects", 302)


async def test_redirect_to_another_scheme_is_refused(server, http) -> None:
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 10)
    with pytest.raises(FetchError) as info:
        await make_fetcher(http, redis).fetch(str(server.make_url("/evil-redirect")), SOURCE)
    assert info.value.status == "BadRedirect"


@pytest.mark.parametrize("path", ["/huge", "/declared-huge"])
async def test_bodies_over_the_cap_are_abandoned(server, http, path: str) -> None:
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 10)
    with pytest.raises(FetchError) as info:
        await make_fetcher(http, redis, max_bytes=15_000).fetch(str(server.make_url(path)), SOURCE)
    assert (info.value.status, info.value.http_status) == ("TooLarge", 200)


async def test_timeouts_and_disconnects_have_names(server, http) -> None:
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 10)
    with pytest.raises(FetchError) as info:
        await make_fetcher(http, redis, total_timeout=0.3).fetch(str(server.make_url("/slow")), SOURCE)
    assert info.value.status == "Timeout"
    with pytest.raises(FetchError) as info:
        await make_fetcher(http, redis).fetch(str(server.make_url("/cut")), SOURCE)
    assert info.value.status == "ServerDisconnected"
    with pytest.raises(FetchError) as info:
        await make_fetcher(http, redis).fetch("http://127.0.0.1:1/nothing-listens", SOURCE)
    assert info.value.status == "ConnectionError"


async def test_error_statuses_are_returned_without_reading_the_body(server, http) -> None:
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 10)
    fetched = await make_fetcher(http, redis).fetch(str(server.make_url("/missing")), SOURCE)
    assert (fetched.status, fetched.body.bytes()) == (404, b"")


@pytest.mark.parametrize("path, signal", [("/noai", "x-robots-tag"), ("/reserved", "tdmrep-header")])
async def test_a_head_that_opts_out_ends_the_fetch_before_the_body(server, http, path, signal) -> None:
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 10)
    fetcher = Fetcher(http, AllowAllGate(), TokenBuckets(redis), 50_000,
                      consent=ResponseConsent(tokens=("cc-image-crawler",)))
    with pytest.raises(FetchError) as info:
        await fetcher.fetch(str(server.make_url(path)), SOURCE)
    assert (info.value.status, info.value.http_status, info.value.decision.signal) == ("OptedOut", 200, signal)
    assert fetcher.body_bytes_held() == 0 and http.idle(str(server.make_url(path))) is None  # closed, not drained
    fetched = await fetcher.fetch(str(server.make_url("/image")), SOURCE)  # the next URL is fetched as ever
    assert fetched.body.bytes() == BODY


async def test_gate_refusal_spends_no_token(server, http) -> None:
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 10)
    url = str(server.make_url("/image"))
    with pytest.raises(FetchError) as info:
        await make_fetcher(http, redis, AllowAllGate({url: "RobotsDisallowed"})).fetch(url, SOURCE)
    assert info.value.status == "RobotsDisallowed"
    assert redis.integer(tokens_key(SOURCE)) == 10 and redis.integer(source_requests_key(SOURCE)) == 0


async def test_no_token_no_request_and_waiters_do_not_busy_loop(server, http) -> None:
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 0)
    fetcher = make_fetcher(http, redis)
    url = str(server.make_url("/image"))
    waiters = [asyncio.create_task(fetcher.fetch(url, SOURCE)) for _ in range(100)]
    await asyncio.sleep(1.0)
    assert server.app[USER_AGENTS] == []
    polls = sum(1 for call in redis.calls if tokens_key(SOURCE) in call[1:])
    assert polls <= 15  # one poller for the source, not a hundred
    await redis.set(tokens_key(SOURCE), 3)  # the monitor's refill
    await asyncio.sleep(1.0)
    assert len(server.app[USER_AGENTS]) == 3
    for waiter in waiters:
        waiter.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)


async def test_the_wait_behind_the_sources_other_waiters_counts_as_token_wait(server, http) -> None:
    """A source's tasks beyond its turns wait for the turn, not for the site or the worker: that
    wait is its rate's, and counted as work it made a source's latency, and so its slots, grow
    with its own tasks waiting (bench.peer_img2dataset)."""
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 0)
    fetcher = make_fetcher(http, redis)  # no rate known: one turn
    url = str(server.make_url("/image"))
    first, second = (asyncio.create_task(fetcher.fetch(url, SOURCE)) for _ in range(2))
    await asyncio.sleep(0.6)
    await redis.set(tokens_key(SOURCE), 2)
    fetched = await asyncio.gather(first, second)
    assert [f.status for f in fetched] == [200, 200]
    assert min(f.token_wait for f in fetched) >= 0.5


async def test_a_fast_source_waits_in_several_turns_a_slow_one_in_one() -> None:
    """A turn passes a token only every few rounds of the event loop: one turn of a busy worker
    served 25-45 tokens a second, and a 100 req/s source got 30-53% of its limit beside 5,000
    slow ones (bench.sources). So a source has a turn per TOKEN_TURN_RATE req/s, handed in rotation."""
    rates = {"fast": 100.0, "slow": 0.5}
    tokens = TokenBuckets(FakeRedis(), MonitorView(rates))
    fast = {id(tokens.turn("fast")) for _ in range(20)}
    assert len(fast) == math.ceil(100.0 / TOKEN_TURN_RATE)
    assert len({id(tokens.turn("slow")) for _ in range(20)}) == 1
    held = [tokens.turn("fast") for _ in range(len(fast))]
    for turn in held:  # as many tasks wait for the fast source's tokens at once
        await asyncio.wait_for(turn.acquire(), 0.1)


async def test_waiting_sources_peek_at_their_buckets_together() -> None:
    """Issue 20: a GET per waiting source per poll was 20,000 round trips a second at 5,000
    slow sources; their peeks share MGETs, one at a time, so the round trips do not grow with them."""
    redis = FakeRedis()
    sources = [f"slow{n}" for n in range(2000)]
    tokens = TokenBuckets(redis, MonitorView({source: 0.5 for source in sources}))
    started = time.monotonic()
    waiters = [asyncio.create_task(tokens.until_available(source)) for source in sources]
    await asyncio.sleep(0.6)
    for source in sources:
        await redis.set(tokens_key(source), 1)
    await asyncio.wait_for(asyncio.gather(*waiters), 2.0)
    elapsed = time.monotonic() - started
    reads = [call for call in redis.calls if call[0] in ("get", "mget")]
    assert sum(len(call) - 1 for call in reads) >= 2 * len(sources)  # each polled a few times
    assert len(reads) <= elapsed / TOKEN_PEEK_INTERVAL + 2  # MGETs spaced apart, not 2,000 GETs a round


async def test_a_failed_peek_reaches_the_waiter_and_the_next_one_works() -> None:
    redis = FakeRedis()
    tokens = TokenBuckets(redis)
    real_mget = redis.mget
    failures = [ConnectionError("redis away")]

    async def mget(keys):
        if failures:
            raise failures.pop()
        return await real_mget(keys)

    redis.mget = mget
    await redis.set(tokens_key(SOURCE), 1)
    with pytest.raises(ConnectionError):
        await tokens.until_available(SOURCE)
    assert await tokens.until_available(SOURCE) >= 0


async def test_closing_the_buckets_releases_waiters_with_shutting_down() -> None:
    redis = FakeRedis()
    tokens = TokenBuckets(redis)
    waiter = asyncio.create_task(tokens.until_available(SOURCE))
    await asyncio.sleep(0.1)
    tokens.close()
    with pytest.raises(ShuttingDown):
        await waiter


async def test_the_token_is_spent_inside_the_host_slot_right_before_sending(server, http) -> None:
    """A token taken before queueing for a busy host would be sent later, in a burst with others."""
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 5)
    seen = []

    class RecordingGate(AllowAllGate):
        @asynccontextmanager
        async def host_slot(self, url: str):
            seen.append(("slot entered", redis.integer(tokens_key(SOURCE))))
            yield

        async def after_response(self, url, source, status, headers) -> None:
            seen.append(("response", redis.integer(tokens_key(SOURCE))))

    await make_fetcher(http, redis, RecordingGate()).fetch(str(server.make_url("/image")), SOURCE)
    assert seen == [("slot entered", 5), ("response", 4)]


# At 10 req/s sends are 0.1 s apart, one going at most PACE_CATCH_UP_SECONDS ahead of its slot.
EVEN_GAP = 0.1 - PACE_CATCH_UP_SECONDS - 0.005


async def test_tasks_of_one_source_opening_connections_to_a_capped_host_all_finish(server, http) -> None:
    """The token is taken with the connection open, and a task gives up its source's turn while
    it connects; waiting for the turn again while holding the host's only slot deadlocked
    against the turn's new holder waiting for that slot (bench.scheduler made no request)."""
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 10)
    one = asyncio.Semaphore(1)

    class OneSlotGate(AllowAllGate):
        @asynccontextmanager
        async def host_slot(self, url: str):
            async with one:
                yield

    fetcher = make_fetcher(http, redis, OneSlotGate())
    urls = [str(server.make_url("/image"))] * 3
    results = await asyncio.wait_for(asyncio.gather(*(fetcher.fetch(u, SOURCE) for u in urls)), 10)
    assert [r.status for r in results] == [200] * 3
    assert redis.integer(tokens_key(SOURCE)) == 7


async def send_for_a_second(tokens: TokenBuckets, sends: list[float], source: str = SOURCE) -> None:
    """Send as a worker would for one second, noting each send's time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 1.0
    while loop.time() < deadline:
        async with tokens.turn(source):
            await tokens.until_available(source)
            if await tokens.take(source):
                sends.append(loop.time())


async def test_requests_to_a_source_are_spaced_across_workers() -> None:
    """Two workers sharing a full bucket still send at most the rate, evenly spaced."""
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 1000)
    sends: list[float] = []

    await asyncio.gather(*(send_for_a_second(TokenBuckets(redis, MonitorView({SOURCE: 10.0})), sends)
                           for _ in range(2)))
    sends.sort()
    assert len(sends) >= 2 and busiest_second(sends)[0] <= allowed_per_second(10.0)
    assert min(b - a for a, b in pairwise(sends)) >= EVEN_GAP


async def test_pacing_survives_a_pause_that_published_rate_zero() -> None:
    """During a Retry-After pause the monitor publishes rate 0; when the bucket refills,
    before the worker sees the rate again, requests must still be spaced (a 429 site saw 48/s at 40/s)."""
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 1000)
    view = MonitorView({SOURCE: 10.0})
    tokens = TokenBuckets(redis, view)
    assert await tokens.take(SOURCE)          # the worker has seen the rate once
    view.decide(rates={SOURCE: 0.0})                       # paused: the monitor says 0, the bucket refills
    sends: list[float] = []
    await send_for_a_second(tokens, sends)
    assert len(sends) >= 1 and busiest_second(sends)[0] <= allowed_per_second(10.0)
    assert min((b - a for a, b in pairwise(sends)), default=1.0) >= EVEN_GAP


@pytest.mark.parametrize("seen, granted, least, most", [
    (2.0, 20.0, 10, 22),   # doubled and more since the worker's last read of the rates: sent at the new pace
    (20.0, 2.0, 1, 4),     # cut meanwhile: after one request at the old pace, the new interval (3 a second)
    (10.0, None, 5, 12),   # no rate in Redis: the worker's view paces
])
async def test_the_next_request_is_paced_by_the_grant_read_with_its_token(seen, granted, least, most) -> None:
    """The pace script returns rate_limit:{source} with the token, so a source's next request
    follows the monitor's grant of this second, not the worker's read of up to REFRESH_INTERVAL
    ago (a slow start's doubling went out at the old pace, and its proof read ~0.7 of it)."""
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 1000)
    if granted is not None:
        await redis.set(rate_limit_key(SOURCE), granted)
    view = MonitorView({SOURCE: seen})
    sends: list[float] = []
    await send_for_a_second(TokenBuckets(redis, view), sends)
    assert least <= len(sends) <= most, sends
    assert busiest_second(sends)[0] <= allowed_per_second(granted or seen)
    assert view.rate(SOURCE) == (granted or seen)


async def test_pacing_script_runs_on_real_redis_with_its_clock(redis_client, unique: str) -> None:
    """The Lua script reads Redis's TIME (one clock for the fleet): on the real server two
    workers sharing a full bucket send at most the rate, evenly spaced."""
    source = f"paced{unique}"
    await redis_client.set(tokens_key(source), 1000, ex=30)
    sends: list[float] = []

    await asyncio.gather(*(send_for_a_second(TokenBuckets(redis_client, MonitorView({source: 10.0})), sends, source)
                           for _ in range(2)))
    sends.sort()
    assert len(sends) >= 5 and busiest_second(sends)[0] <= allowed_per_second(10.0)
    assert min(b - a for a, b in pairwise(sends)) >= EVEN_GAP
    assert int(await redis_client.get(source_requests_key(source))) == len(sends)


async def test_catch_up_never_puts_more_than_floor_rate_plus_one_in_a_second(redis_client, unique: str) -> None:
    """Three workers asking as fast as they can at 100.5 req/s: pacing with its catch-up alone
    would allow ~105 in a second (a burst, then 100.5/s); the send log holds it to 101."""
    source = f"logged{unique}"
    await redis_client.set(tokens_key(source), 100_000, ex=30)
    sends: list[float] = []

    async def greedy(tokens: TokenBuckets) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2.5
        while loop.time() < deadline:
            if await tokens.take(source):
                sends.append(loop.time())
            await asyncio.sleep(0)

    await asyncio.gather(*(greedy(TokenBuckets(redis_client, MonitorView({source: 100.5}))) for _ in range(3)))
    sends.sort()
    assert len(sends) >= 100
    assert busiest_second(sends)[0] <= allowed_per_second(100.5) == 101
    assert await redis_client.llen(sent_log_key(source)) == 101


def answering_after(redis: FakeRedis, delays: list[float]) -> None:
    """Make the pace script's answers arrive after these delays, one per call (a stall
    between Redis's decision and the worker reading it)."""
    decide = redis.register_script(PACED_DECR)

    async def decided_then_delayed(keys, args):
        answer = await decide(keys, args)
        await asyncio.sleep(delays.pop(0))
        return answer
    redis.register_script = lambda script: decided_then_delayed


async def takes(tokens: TokenBuckets, count: int) -> list[bool]:
    results = []
    for _ in range(count):
        await asyncio.sleep(0.02)  # past the pace interval (rate 100/s)
        results.append(await tokens.take(SOURCE) is not None)
    return results


async def test_a_token_answered_late_is_forfeited_and_not_counted(capsys) -> None:
    """A worker stalled while its token's answer waited must not send: the request would
    reach the site bunched with the next one. The token is gone, the request not counted."""
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 10)
    stall = STALE_TOKEN_SECONDS + 0.05
    answering_after(redis, [0, 0, 0, stall, stall, 0])
    tokens = TokenBuckets(redis, MonitorView({SOURCE: 100.0}))
    assert await takes(tokens, 6) == [True, True, True, False, False, True]
    assert redis.integer(tokens_key(SOURCE)) == 4
    assert redis.integer(source_requests_key(SOURCE)) == 4
    reports = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # Reported once a minute, not once a token.
    assert [(r["event"], r["by_source"]) for r in reports] == [("worker_tokens_forfeited", {SOURCE: 1})]


async def test_a_stall_between_the_token_and_the_write_forfeits_the_token(server, http, monkeypatch, capsys) -> None:
    """A pause after the token's answer (a garbage collection, the kernel's scheduler) delays the
    request as much as one before it: the request would reach the site bunched with the next
    ones. Its deadline is judged just before the write: nothing is sent, the token is forfeited
    (uncounted), and the request goes with the next token."""
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 10)
    stalls = [STALE_TOKEN_SECONDS + 0.05]
    real_get = http.get

    def stalled_get(*args, **kwargs):
        if stalls:
            time.sleep(stalls.pop())  # blocks the loop, as a collection does
        return real_get(*args, **kwargs)

    monkeypatch.setattr(http, "get", stalled_get)  # called with the token's deadline in hand
    fetched = await make_fetcher(http, redis).fetch(str(server.make_url("/image")), SOURCE)
    assert (fetched.status, fetched.body.bytes()) == (200, BODY)
    assert len(server.app[USER_AGENTS]) == 1  # the site saw the request once, sent on time
    assert redis.integer(tokens_key(SOURCE)) <= 8  # two at least: a loaded machine may stall again
    assert redis.integer(source_requests_key(SOURCE)) == 1
    reports = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["event"], r["by_source"]) for r in reports] == [("worker_tokens_forfeited", {SOURCE: 1})]


async def test_a_redis_that_always_answers_slowly_forfeits_nothing() -> None:
    """Late means later than usual: a far-away Redis must not stop the crawl."""
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 10)
    answering_after(redis, [STALE_TOKEN_SECONDS + 0.03] * 5)
    assert await takes(TokenBuckets(redis, MonitorView({SOURCE: 100.0})), 5) == [True] * 5


async def test_a_name_that_resolves_to_a_private_address_at_connect_time_is_forbidden(server) -> None:
    """The SSRF guard's second layer: the address connected to is checked, not only the URL."""
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 10)
    client = HttpClient(USER_AGENT, resolver=GuardedResolver(LoopbackResolver()))
    try:
        with pytest.raises(FetchError) as info:
            await make_fetcher(client, redis).fetch(f"http://images.example:{server.port}/image", SOURCE)
    finally:
        await client.close()
    assert info.value.status == "ForbiddenAddress"
    assert server.app[USER_AGENTS] == []


class NoSuchName(LoopbackResolver):
    async def resolve(self, host, port=0, family=socket.AF_INET):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


async def test_a_name_that_does_not_resolve_is_a_connection_error() -> None:
    """A dead domain: retried like a refused connection, not logged as a crawler bug."""
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 10)
    client = HttpClient(USER_AGENT, resolver=NoSuchName())
    try:
        with pytest.raises(FetchError) as info:
            await make_fetcher(client, redis).fetch("http://gone.example/a.jpg", SOURCE)
    finally:
        await client.close()
    assert info.value.status == "ConnectionError"


async def test_past_the_body_budget_a_download_waits_for_a_body_to_be_analysed(server, http) -> None:
    """No token is spent and nothing is sent while the bodies in hand hold the budget."""
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 10)
    fetcher = Fetcher(http, AllowAllGate(), TokenBuckets(redis), 50_000, body_budget=1)
    first = await fetcher.fetch(str(server.make_url("/image")), SOURCE)
    second = asyncio.create_task(fetcher.fetch(str(server.make_url("/image")), SOURCE))
    await asyncio.sleep(0.3)
    assert not second.done() and len(server.app[USER_AGENTS]) == 1
    first.body.release()  # the image pool is done with it
    fetched = await asyncio.wait_for(second, 5)
    assert fetched.body.bytes() == BODY and len(server.app[USER_AGENTS]) == 2
    fetched.body.release()


async def test_a_non_ascii_location_is_read_as_utf8(http) -> None:
    """A redirect to a Unicode path (aiohttp and browsers send it as UTF-8 bytes) is followed
    to that path, not to its latin-1 mojibake."""
    seen: list[str] = []

    async def moved(_request: web.Request) -> web.Response:
        return web.Response(status=302, headers={"Location": "/bild-ä.png"})

    async def image(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.Response(body=BODY, content_type="image/png")

    app = web.Application()
    app.router.add_get("/moved", moved)
    app.router.add_get("/bild-ä.png", image)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        redis = FakeRedis()
        await redis.set(tokens_key(SOURCE), 10)
        fetched = await make_fetcher(http, redis).fetch(str(server.make_url("/moved")), SOURCE)
        assert fetched.status == 200 and seen == ["/bild-ä.png"]
        fetched.body.release()
    finally:
        await server.close()


async def test_a_waiting_source_is_marked_active_and_idle_ones_are_forgotten(monkeypatch) -> None:
    """Issue 26: the monitor grants tokens only to sources in active_sources, so a task waiting for
    a new source's first token says so; and a worker that met 1,000 sources keeps nothing of those
    no task has asked tokens for in a while."""
    from common.contracts import WAITING_SOURCES, rate_limit_key
    from worker.fetching import tokens as tokens_module
    from worker.constants import TOKENS_FORGET_SECONDS
    redis = FakeRedis()
    tokens = TokenBuckets(redis)
    waiter = asyncio.create_task(tokens.until_available("new"))
    await asyncio.sleep(0.05)
    assert "new" in redis.store.get(WAITING_SOURCES, {})  # before any outcome: the monitor may grant it
    await redis.set(tokens_key("new"), 1)
    await redis.set(rate_limit_key("new"), 2.0)
    await asyncio.wait_for(waiter, 2)
    assert await tokens.take("new")  # its rate read from Redis: paced from the first request
    assert redis.store[sent_log_key("new")]
    for n in range(1_000):
        async with tokens.turn(f"s{n}"):
            await redis.set(tokens_key(f"s{n}"), 1)
            await tokens.take(f"s{n}")
    later = time.monotonic() + 2 * TOKENS_FORGET_SECONDS + 1
    monkeypatch.setattr(tokens_module.time, "monotonic", lambda: later)
    tokens.turn("busy")
    monkeypatch.undo()  # time.monotonic is the event loop's clock too
    assert tokens.remembered_sources() == {"busy"}


@pytest.mark.parametrize("checks, held, paced", [
    ((TOKENS_FORGET_SECONDS - 1,), False, True),     # paused less than the window: still paced by its last rate
    ((TOKENS_FORGET_SECONDS - 1, TOKENS_FORGET_SECONDS + TOKENS_FORGET_CHECK_SECONDS), False, False),
    ((TOKENS_FORGET_SECONDS - 1, TOKENS_FORGET_SECONDS + 1), False, True),  # the next check is not due yet
    ((TOKENS_FORGET_SECONDS + 1,), False, False),    # idle past the window: starts afresh
    ((TOKENS_FORGET_SECONDS + TOKENS_FORGET_CHECK_SECONDS,), True, True),  # a task holds its turn
])
async def test_a_paused_source_is_paced_for_the_whole_window_and_forgotten_soon_after(
        monkeypatch, checks, held, paced) -> None:
    """A source is forgotten TOKENS_FORGET_SECONDS after its last token (not before: its last rate
    paces its first request once a pause ends), at a check made every TOKENS_FORGET_CHECK_SECONDS
    (``checks``: seconds after its last token that other sources' turns were asked for)."""
    from worker.fetching import tokens as tokens_module
    redis = FakeRedis()
    await redis.set(tokens_key(SOURCE), 1000)
    view = MonitorView({SOURCE: 10.0})
    tokens = TokenBuckets(redis, view)
    turn = tokens.turn(SOURCE)
    await turn.acquire()
    assert await tokens.take(SOURCE)
    if not held:
        turn.release()
    view.decide(rates={SOURCE: 0.0})  # paused: the monitor publishes 0, and no rate_limit key
    last_token = time.monotonic()
    for n, after in enumerate(checks):
        monkeypatch.setattr(tokens_module.time, "monotonic", lambda after=after: last_token + after)
        tokens.turn(f"other-{n}")
        monkeypatch.undo()  # time.monotonic is the event loop's clock too
    assert (SOURCE in tokens.remembered_sources()) is paced
    for key in (send_pace_key(SOURCE), sent_log_key(SOURCE)):
        redis.store.pop(key, None)
    assert await tokens.take(SOURCE)
    assert bool(redis.store.get(sent_log_key(SOURCE))) is paced  # logged only when its rate is known
