"""Politeness proved from the website's side: what a local site received, and when."""
from __future__ import annotations

import asyncio
import time
from itertools import pairwise

import pytest

from common.contracts import retry_after_key
from common.settings import Settings
from test.sites import TEST_USER_AGENT, Page, Site, fetch_politely, run_racing
from test.worker_fakes import LoopbackResolver
from worker.fetching.http_client import HttpClient
from worker.politeness.addresses import system_resolve
from worker.politeness.gate import build_gate
from worker.politeness.tdmrep import TDMREP_PATH

pytestmark = pytest.mark.paced  # runs by itself, after the rest (pytest.ini)



def settings(redis_url: str, **overrides) -> Settings:
    values = dict(redis_url=redis_url, crawl_user_agent=TEST_USER_AGENT,
                  crawl_allow_private_networks=True)
    return Settings(**{**values, **overrides})


@pytest.fixture
async def client():
    client = HttpClient(TEST_USER_AGENT)
    yield client
    await client.close()


async def run_crawlers(redis_url: str, url_lists: list[list[str]]) -> list[list]:
    """Run one crawler process per URL list, all racing; their outcomes."""
    return await run_racing("test.sites", [[redis_url, str(len(url_lists)), *urls] for urls in url_lists], 60)


async def test_disallowed_paths_are_never_requested(redis_client, redis_url, client):
    robots = ("User-agent: *\nDisallow: /\n\n"
              "User-agent: polite-test-bot\nDisallow: /secret\nAllow: /secret/ok\n")
    async with Site({"/robots.txt": Page(body=robots),
                     "/go": Page(302, headers={"Location": "/secret/x"})}) as site:
        gate = build_gate(settings(redis_url), redis_client, client)
        paths = ["/a", "/secret/x", "/secret/ok/y", "/private/z", "/go", "/secret"]
        outcomes = await asyncio.gather(
            *(fetch_politely(gate, client, site.url + p, "test") for p in paths))
    assert outcomes == [200, "RobotsDisallowed", 200, 200, "RobotsDisallowed", "RobotsDisallowed"]
    assert sorted(site.paths()) == [TDMREP_PATH, "/a", "/go", "/private/z", "/robots.txt", "/secret/ok/y"]
    assert all(hit.user_agent == TEST_USER_AGENT for hit in site.hits)


async def test_robots_fetched_once_across_three_processes(redis_url):
    async with Site({"/robots.txt": Page(body="User-agent: *\nDisallow: /no\n", delay=0.5)}) as site:
        urls = [f"{site.url}/img/{i}" for i in range(15)] + [f"{site.url}/no/1"]
        outcomes = await run_crawlers(redis_url, [urls, urls, urls])
    assert site.paths().count("/robots.txt") == 1
    assert all(o == [200] * 15 + ["RobotsDisallowed"] for o in outcomes)
    assert len(site.times("/img/")) == 45 and not site.times("/no/")


async def test_crawl_delay_spaces_requests_across_two_processes(redis_url):
    async with Site({"/robots.txt": Page(body="User-agent: *\nCrawl-delay: 2\n")}) as site:
        outcomes = await run_crawlers(redis_url, [[f"{site.url}/p/{w}/{i}" for i in range(2)]
                                                  for w in range(2)])
    assert outcomes == [[200, 200], [200, 200]]
    times = site.times("/p/")
    gaps = [b - a for a, b in pairwise(times)]
    assert len(times) == 4 and min(gaps) >= 2.0 - 1e-3, gaps


async def test_per_host_connection_cap(redis_client, redis_url, client):
    async with Site(default=Page(delay=0.2)) as site:
        gate = build_gate(settings(redis_url, crawl_per_host_connections=3), redis_client, client)
        outcomes = await asyncio.gather(
            *(fetch_politely(gate, client, f"{site.url}/i/{i}", "test") for i in range(12)))
    assert outcomes == [200] * 12
    assert site.max_in_flight == 3


async def test_429_with_retry_after_pauses_the_source(redis_client, redis_url, client):
    async with Site({"/busy": Page(429, headers={"Retry-After": "5"}),
                     "/down": Page(503, headers={"Retry-After": "1"})}) as site:
        gate = build_gate(settings(redis_url), redis_client, client)
        before = time.time()
        assert await fetch_politely(gate, client, site.url + "/busy", "paused") == 429
        after = time.time()
        until = int(await redis_client.get(retry_after_key("paused")))
        assert before + 5 <= until <= after + 6
        # A shorter pause from a later response never shortens the one in force.
        assert await fetch_politely(gate, client, site.url + "/down", "paused") == 503
        assert int(await redis_client.get(retry_after_key("paused"))) == until
        assert 0 < await redis_client.ttl(retry_after_key("paused")) <= 5 + 61


async def test_redirect_to_internal_address_is_refused_per_hop(redis_client, redis_url):
    async def public_dns(host: str, port: int) -> list[str]:
        if host == "public.test":
            return ["93.184.216.34"]  # what the guard believes; no traffic goes there
        return await system_resolve(host, port)

    async with Site() as site:
        port = site.url.rsplit(":", 1)[1]
        public = f"http://public.test:{port}"
        site.pages["/img"] = Page(302, headers={"Location": f"http://127.0.0.1:{port}/internal"})
        site.pages["/meta"] = Page(302, headers={"Location": "http://169.254.169.254/latest/"})
        site.pages["/local"] = Page(302, headers={"Location": f"http://localhost:{port}/internal"})
        client = HttpClient(TEST_USER_AGENT, resolver=LoopbackResolver())
        try:
            gate = build_gate(settings(redis_url, crawl_allow_private_networks=False),
                              redis_client, client, resolve=public_dns)
            outcomes = [await fetch_politely(gate, client, public + p, "test")
                        for p in ("/img", "/meta", "/local", "/fine")]
        finally:
            await client.close()
    assert outcomes == ["ForbiddenAddress"] * 3 + [200]
    assert sorted(site.paths()) == [TDMREP_PATH, "/fine", "/img", "/local", "/meta", "/robots.txt"]
