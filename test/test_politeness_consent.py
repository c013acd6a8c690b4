"""Consent signals beyond robots.txt's Allow/Disallow: tables for the pure policy (path patterns,
TDMRep rules, response heads, AI preferences, extra product tokens), and tdmrep.json fetched
from a local site and shared through Redis, hostile files included."""
from __future__ import annotations

import asyncio
import json

import pytest
from multidict import CIMultiDict

from common.contracts import (SIGNAL_CONTENT_USAGE_HEADER, SIGNAL_ROBOTS, SIGNAL_ROBOTS_CONTENT_USAGE,
                              SIGNAL_ROBOTS_EXTRA, SIGNAL_TDMREP_FILE, SIGNAL_TDMREP_HEADER, SIGNAL_X_ROBOTS_TAG,
                              robots_key, tdmrep_key)
from common.statuses import Status
from test.sites import TEST_USER_AGENT, Page, Site
from worker.fetching.http_client import HttpClient
from worker.politeness import Refused
from worker.politeness.addresses import AddressGuard
from worker.politeness.consent import ResponseConsent, usage_refusal
from worker.politeness.path_pattern import FirstMatch, LongestMatch, normalise, url_path
from worker.politeness.robots import (ALLOW_ALL, DISALLOW_ALL, RULES, UNAVAILABLE, RobotsCache, RobotsFile, Rules,
                                      origin_of)
from worker.politeness.tdmrep import (MAX_FILE_BYTES, TDMREP_PATH, TdmRepCache, TdmRules, condensed_rules,
                                      fetch_tdmrep)

pytestmark = pytest.mark.paced  # runs by itself, after the rest (pytest.ini)

TOKEN = "polite-test-bot"
OPEN = AddressGuard(enabled=False)
BASE = "http://example.org"


@pytest.mark.parametrize("pattern, path, matches", [
    ("/photos/", "/photos/a.jpg", True),
    ("/photos/", "/photo/a.jpg", False),
    ("/photos/*.jpg", "/photos/x/y.jpg", True),
    ("/photos/*.jpg", "/photos/x/y.png", False),
    ("/*.jpg$", "/a.jpg", True),
    ("/*.jpg$", "/a.jpg?size=2", False),
    ("/a$", "/a/b", False),
    ("/", "/anything", True),
    ("/%7Euser/", "/~user/x", True),        # unreserved: decoded on both sides
    ("/~user/", "/%7euser/x", True),
    ("/a%2Fb", "/a/b", False),               # reserved: stays encoded
    ("/path/foo-%24", "/path/foo-%24", True),  # a literal $ is written encoded
    ("/Photos/", "/photos/a", False),        # case-sensitive
])
def test_path_patterns(pattern, path, matches):
    assert (FirstMatch([pattern]).first(normalise(path)) == 0) is matches


def test_the_first_matching_location_decides_and_the_longest_content_usage_rule():
    first = FirstMatch(["/a/*.png", "/a/", "/"])
    assert [first.first(p) for p in ("/a/x.png", "/a/x.jpg", "/b")] == [0, 1, 2]
    longest = LongestMatch([("/a", "n"), ("/a/b/", "y"), ("", "root")])
    assert [longest.best(p) for p in ("/a/x", "/a/b/c", "/z")] == ["n", "y", "root"]
    assert url_path("http://h/p%7e?q=1") == "/p~?q=1" and url_path("http://h") == "/"


def test_thousands_of_locations_compile_to_one_expression():
    first = FirstMatch([f"/dir{i}/" for i in range(5000)])
    assert first.first("/dir4999/x") == 4999 and first.first("/other") is None


TDM = [{"location": "/photos/", "tdm-reservation": 1, "tdm-policy": "https://example.org/policy.json"},
       {"location": "/photos/free/", "tdm-reservation": 0},  # never reached: the first match decides
       {"location": "/open/", "tdm-reservation": 0},
       {"location": "/*.tif$", "tdm-reservation": 1}]


@pytest.mark.parametrize("path, value", [
    ("/photos/a.jpg", "/photos/ reserved (policy https://example.org/policy.json)"),
    ("/photos/free/a.jpg", "/photos/ reserved (policy https://example.org/policy.json)"),
    ("/open/a.jpg", None),
    ("/scan.tif", "/*.tif$ reserved"),
    ("/scan.tif?x", None),
    ("/elsewhere.jpg", None),
])
def test_tdmrep_rules(path, value):
    rules = TdmRules(RobotsFile(RULES, condensed_rules(json.dumps(TDM)) or ""))
    decision = rules.refusal(BASE + path)
    assert (decision and decision.value) == value
    assert decision is None or decision.signal == SIGNAL_TDMREP_FILE


@pytest.mark.parametrize("text, kept", [
    ("not json at all", ""),
    ("<html>Soft 404</html>", ""),
    ('{"location": "/", "tdm-reservation": 1}', ""),               # not an array
    ("[" * 100_000 + "]" * 100_000, ""),                           # nested past the parser
    ('[{"location": "/", "tdm-reservation": "1"}]', "[]"),          # a protocol error: skipped
    ('[{"location": "/", "tdm-reservation": true}]', "[]"),
    ('[{"tdm-reservation": 1}, 5, null, {"location": 7, "tdm-reservation": 1}]', "[]"),
    ('[{"location": "/a/", "tdm-reservation": 1, "tdm-policy": 3}]', '[["/a/",1,null]]'),
])
def test_condensed_rules_of_hostile_files(text, kept):
    assert condensed_rules(text) == kept


def test_rules_too_long_to_keep_are_none():
    many = [{"location": f"/d{i}/" + "x" * 100, "tdm-reservation": 0} for i in range(1000)]
    assert condensed_rules(json.dumps(many)) is None


def heads(**headers: str) -> CIMultiDict:
    multi: CIMultiDict = CIMultiDict()
    for name, value in headers.items():
        for one in value.split("|"):
            multi.add(name.replace("_", "-"), one)
    return multi


CONSENT = ResponseConsent(tokens=(TOKEN, "CCBot"))


@pytest.mark.parametrize("headers, signal, value", [
    ({}, None, None),
    ({"tdm_reservation": "1"}, SIGNAL_TDMREP_HEADER, "1"),
    ({"tdm_reservation": "1", "tdm_policy": "https://x/p"}, SIGNAL_TDMREP_HEADER, "1 (policy https://x/p)"),
    ({"tdm_reservation": "0"}, None, None),
    ({"tdm_reservation": "yes"}, None, None),              # a protocol error: unset
    ({"tdm_reservation": "1|0"}, None, None),              # the last one stands
    ({"X_Robots_Tag": "noai"}, SIGNAL_X_ROBOTS_TAG, "noai"),
    ({"X_Robots_Tag": "noindex, noimageai"}, SIGNAL_X_ROBOTS_TAG, "noindex, noimageai"),
    ({"X_Robots_Tag": "polite-test-bot: noai"}, SIGNAL_X_ROBOTS_TAG, "polite-test-bot: noai"),
    ({"X_Robots_Tag": "ccbot: NoAI"}, SIGNAL_X_ROBOTS_TAG, "ccbot: NoAI"),  # an extra token binds us too
    ({"X_Robots_Tag": "otherbot: noai"}, None, None),      # another bot's only
    ({"X_Robots_Tag": "noindex"}, None, None),             # no thumbnail, but not an opt-out
    ({"Content_Usage": "train-ai=n"}, SIGNAL_CONTENT_USAGE_HEADER, "train-ai=n"),
    ({"Content_Usage": "search=n, train-ai=y"}, None, None),
    ({"Content_Usage": "train-ai=y|train-ai=n"}, SIGNAL_CONTENT_USAGE_HEADER, "train-ai=n"),  # most restrictive
    ({"Content_Usage": 'train-ai="n"'}, None, None),       # not a token: unknown
    ({"Content_Usage": "Train-AI=n"}, None, None),         # does not parse: unknown
    ({"Content_Usage": "train-ai=n;" + "x" * 10_000}, None, None),  # enormous: not parsed
    ({"Content_Usage": "\x00\xff=="}, None, None),
    ({"X_Robots_Tag": "x" * 60_000 + ", noai"}, SIGNAL_X_ROBOTS_TAG, "x" * 300),  # read whole, value cut
    ({"X_Robots_Tag": ":::,,,\t"}, None, None),
])
def test_a_response_head_decides_before_the_body(headers, signal, value):
    decision = CONSENT.refusal(heads(**headers))
    assert (decision and decision.signal, decision and decision.value) == (signal, value)


def test_each_header_signal_has_its_switch():
    off = ResponseConsent(tokens=(TOKEN,), x_robots_tag=False, tdmrep=False, content_usage=False)
    assert off.refusal(heads(tdm_reservation="1", X_Robots_Tag="noai", Content_Usage="train-ai=n")) is None
    wider = ResponseConsent(tokens=(TOKEN,), directives=frozenset({"noai", "noindex"}))
    assert wider.refusal(heads(X_Robots_Tag="noindex")) is not None


@pytest.mark.parametrize("statement, categories, refused", [
    ("train-ai=n", ("train-ai",), "train-ai"),
    ("train-ai=n", ("search",), None),
    ("search=n, train-ai=n", ("search", "train-ai"), "search"),
    ("train-ai=y", ("train-ai",), None),
    ("train-ai;allow=n, train-ai=n", ("train-ai",), "train-ai"),
    ("train-ai=n, train-ai=y", ("train-ai",), None),  # a repeated key: the last value stands
    ("", ("train-ai",), None),
])
def test_ai_preference_statements(statement, categories, refused):
    assert usage_refusal(statement, categories) == refused


ROBOTS = """
User-agent: *
Disallow: /private/
Content-Usage: train-ai=n
Content-Usage: /free/ train-ai=y

User-agent: CCBot
Disallow: /ccbot-out/

User-agent: otherbot
Disallow: /
"""


@pytest.mark.parametrize("path, extra, categories, signal", [
    ("/a.jpg", (), (), None),
    ("/private/a.jpg", (), (), SIGNAL_ROBOTS),
    ("/ccbot-out/a.jpg", (), (), None),
    ("/ccbot-out/a.jpg", ("CCBot",), (), SIGNAL_ROBOTS_EXTRA),
    ("/ccbot-out/a.jpg", ("otherbot",), (), SIGNAL_ROBOTS_EXTRA),  # otherbot's Disallow: / binds
    ("/a.jpg", (), ("train-ai",), SIGNAL_ROBOTS_CONTENT_USAGE),
    ("/free/a.jpg", (), ("train-ai",), None),   # the longer rule allows
    ("/a.jpg", (), ("search",), None),
])
async def test_robots_groups_of_extra_tokens_and_content_usage_bind(redis_client, path, extra, categories, signal):
    async def fetch(origin: str) -> RobotsFile:
        return RobotsFile(RULES, ROBOTS, 200)

    cache = RobotsCache(redis_client, fetch, TOKEN, extra_tokens=extra, categories=categories)
    origin = f"http://consent-{len(extra)}-{len(categories)}-{abs(hash(path))}.test"
    rules = await cache.rules(origin)
    decision = rules.refusal(origin + path)
    assert (decision and decision.signal) == signal


@pytest.mark.parametrize("stored_tokens, extra, fetched", [
    (None, (), 1),                # an older record, kept for no tokens
    ([TOKEN], (), 0),             # kept for exactly our tokens
    ([TOKEN], ("CCBot",), 1),     # kept without a token we now answer to
])
async def test_a_record_kept_for_other_tokens_is_fetched_again(redis_client, stored_tokens, extra, fetched):
    origin = f"http://kept-{len(extra)}-{stored_tokens is None}.test"
    stored = RobotsFile(RULES, "User-agent: *\nDisallow: /x\n", 200, tokens=stored_tokens or [])
    await redis_client.set(robots_key(origin), stored.to_json(), ex=60)
    fetches: list[str] = []

    async def fetch(asked: str) -> RobotsFile:
        fetches.append(asked)
        return RobotsFile(RULES, "", 200)

    await RobotsCache(redis_client, fetch, TOKEN, extra_tokens=extra).rules(origin)
    assert len(fetches) == fetched


async def test_rules_too_long_for_one_group_disallow_everything(redis_client):
    huge = "User-agent: CCBot\n" + "".join(f"Disallow: /d{i}/{'x' * 50}\n" for i in range(2000))
    origin = "http://huge-group.test"
    await redis_client.delete(robots_key(origin))

    async def fetch(_origin: str) -> RobotsFile:
        return RobotsFile(RULES, huge, 200)

    rules = await RobotsCache(redis_client, fetch, TOKEN, extra_tokens=("CCBot",)).rules(origin)
    assert rules.verdict == DISALLOW_ALL
    assert Rules(RobotsFile(DISALLOW_ALL, status=200), TOKEN).refusal(BASE + "/a").signal == SIGNAL_ROBOTS


@pytest.fixture
async def client():
    client = HttpClient(TEST_USER_AGENT)
    yield client
    await client.close()


@pytest.mark.parametrize("page, verdict", [
    (Page(body=json.dumps(TDM)), RULES),
    (Page(body="[]"), ALLOW_ALL),
    (Page(body="<html>no such page</html>"), ALLOW_ALL),
    (Page(body="{" * 200_000), ALLOW_ALL),                                   # nested, not JSON
    (Page(body="[" + " " * (MAX_FILE_BYTES + 10) + "]"), DISALLOW_ALL),        # a huge array
    (Page(body="<html>" + "x" * (MAX_FILE_BYTES + 10)), ALLOW_ALL),           # a huge page
    (Page(404), ALLOW_ALL), (Page(410), ALLOW_ALL), (Page(403), ALLOW_ALL),
    (Page(500), UNAVAILABLE), (Page(503), UNAVAILABLE), (Page(429), UNAVAILABLE),
])
async def test_tdmrep_answers(client, page, verdict):
    async with Site({TDMREP_PATH: page}) as site:
        file = await fetch_tdmrep(client, origin_of(site.url), OPEN)
    assert file.verdict == verdict


async def test_a_tdmrep_redirect_loop_is_no_file(client):
    async with Site() as site:
        site.pages[TDMREP_PATH] = Page(301, headers={"Location": "/loop"})
        site.pages["/loop"] = Page(302, headers={"Location": TDMREP_PATH})
        file = await fetch_tdmrep(client, origin_of(site.url), OPEN)
    assert file.verdict == ALLOW_ALL and len(site.hits) == 6


async def test_a_tdmrep_redirect_to_a_forbidden_address_reserves_everything(client):
    async with Site({TDMREP_PATH: Page(302, headers={"Location": "http://10.0.0.1/tdmrep.json"})}) as site:
        file = await fetch_tdmrep(client, origin_of(site.url), AddressGuard(enabled=True))
    assert file.verdict == DISALLOW_ALL and site.hits == []


async def test_tdmrep_is_fetched_once_for_many_urls_and_shared(redis_client, client):
    async with Site({TDMREP_PATH: Page(body=json.dumps(TDM), delay=0.2)}) as site:
        origin = origin_of(site.url)
        await redis_client.delete(tdmrep_key(origin))

        def cache() -> TdmRepCache:
            async def fetch(o: str) -> RobotsFile:
                return await fetch_tdmrep(client, o, OPEN)
            return TdmRepCache(redis_client, fetch, TOKEN)

        workers = [cache() for _ in range(3)]
        urls = [f"{site.url}/photos/{i}.jpg" for i in range(10)] + [f"{site.url}/open/{i}.jpg" for i in range(10)]
        results = await asyncio.gather(*(w.check(u) for w in workers for u in urls), return_exceptions=True)
    assert len(site.hits) == 1
    refused = [r for r in results if isinstance(r, Refused)]
    assert len(refused) == 30 and {r.reason for r in refused} == {Status.OPTED_OUT}
    assert {r.decision.value for r in refused} == {"/photos/ reserved (policy https://example.org/policy.json)"}
    assert results.count(None) == 30


async def test_an_unavailable_tdmrep_delays_the_url_never_ends_it(redis_client):
    async def fetch(origin: str) -> RobotsFile:
        return RobotsFile(UNAVAILABLE, status=503)

    cache = TdmRepCache(redis_client, fetch, TOKEN)
    origin = "http://tdmrep-outage.test"
    await redis_client.delete(tdmrep_key(origin))
    with pytest.raises(Refused) as refused:
        await cache.check(origin + "/photos/a.jpg")
    assert refused.value.reason == Status.TDMREP_UNAVAILABLE and refused.value.retry_at is not None
    assert refused.value.decision is None
