"""robots.txt kept small: only our group in Redis, a byte budget for parsed rules in memory."""
from __future__ import annotations

import random
import tracemalloc

import pytest
from protego import Protego

from common.contracts import robots_key
from worker.politeness import Refused
from worker.politeness.robots import (DISALLOW_ALL, RULES, RobotsCache, RobotsFile, Rules)
from worker.politeness.robots_group import MAX_GROUP_BYTES, GroupTooLarge, our_group
from worker.politeness.ttl_cache import TtlCache

pytestmark = pytest.mark.paced  # runs by itself, after the rest (pytest.ini)

TOKEN = "polite-test-bot"
AGENTS = ["*", "polite-test-bot", "Polite-Test-Bot", "polite", "test-bot", "polite-test-botty",
          "googlebot", "*bot*", "polite-test-bot/2.0", "other"]
PATHS = ["/", "/a", "/a/b", "/a/b.php", "/img/x.jpg", "/img/", "/search?q=1", "/x$", "/%7Euser",
         "/~user", "/index.html", "/a*b", "/private/", "/a/b/c/d", "/$"]


def random_robots(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(0, 6)):
        for _ in range(rng.randint(1, 3)):
            lines.append(f"{rng.choice(['User-agent', 'user-agent', 'User agent'])}: {rng.choice(AGENTS)}")
        for _ in range(rng.randint(0, 6)):
            kind = rng.choice(["Allow", "Disallow", "disallow", "Crawl-delay", "Sitemap", "Host",
                               "Noindex", "# comment", ""])
            value = rng.choice(PATHS) if kind not in ("Crawl-delay",) else rng.choice(["1", "2.5", "x", "-1"])
            if rng.random() < 0.2:
                value += rng.choice(["*", "$", "*.php$", " # trailing"])
            lines.append(f"{kind}: {value}" if kind and not kind.startswith("#") else kind)
    return "\n".join(lines) + "\n"


def test_our_group_answers_as_the_whole_file_does():
    """Differential: 2,000 random files, every path and several tokens, group against the whole."""
    rng = random.Random(7)
    for _ in range(2000):
        body = random_robots(rng)
        for token in (TOKEN, "unknownbot", "googlebot"):
            full, group = Protego.parse(body), Protego.parse(our_group(body, token))
            for path in PATHS:
                url = "http://h" + path
                assert group.can_fetch(url, token) == full.can_fetch(url, token), (body, token, path)
            assert group.crawl_delay(token) == full.crawl_delay(token), (body, token)


ROBOTS = """
Sitemap: http://h/sitemap.xml
User-agent: *
Disallow: /everyone-out

User-agent: otherbot
Disallow: /
Crawl-delay: 9

User-agent: polite-test-bot
Disallow: /a
Allow: /a/b
Crawl-delay: 2.5
"""


def test_only_our_group_is_kept():
    assert our_group(ROBOTS, TOKEN) == ("User-agent: polite-test-bot\nDisallow: /a\nAllow: /a/b\n"
                                        "Crawl-delay: 2.5\n")
    assert our_group(ROBOTS, "unknownbot") == "User-agent: *\nDisallow: /everyone-out\n"  # * fallback
    assert our_group("User-agent: otherbot\nDisallow: /\n", TOKEN) == ""  # nothing for us: allowed
    assert Protego.parse("").can_fetch("http://h/x", TOKEN)


def test_a_group_past_the_bound_is_refused():
    rules = "".join(f"Disallow: /p{i}\n" for i in range(MAX_GROUP_BYTES // 10))
    with pytest.raises(GroupTooLarge):
        our_group("User-agent: *\n" + rules, TOKEN)


async def test_redis_holds_our_group_only_for_a_hostile_500_kib_file(redis_client):
    others = "".join(f"User-agent: bot{i}\n" + "Disallow: /" + "x" * 200 + "\n" * 1 for i in range(2300))
    body = others + "User-agent: polite-test-bot\nDisallow: /no\n"
    assert len(body) > 490_000

    async def fetch(_origin: str) -> RobotsFile:
        return RobotsFile(RULES, body, 200)

    cache = RobotsCache(redis_client, fetch, TOKEN)
    await cache.check("http://hostile.example/yes")
    with pytest.raises(Refused, match="RobotsDisallowed"):
        await cache.check("http://hostile.example/no/1")
    stored = RobotsFile.from_json(await redis_client.get(robots_key("http://hostile.example:80")))
    assert stored.body == "User-agent: polite-test-bot\nDisallow: /no\n"
    assert len(await redis_client.get(robots_key("http://hostile.example:80"))) < 200


async def test_a_huge_group_for_us_disallows_all(redis_client):
    body = "User-agent: *\n" + "".join(f"Allow: /p{i}\n" for i in range(40_000))

    async def fetch(_origin: str) -> RobotsFile:
        return RobotsFile(RULES, body, 200)

    with pytest.raises(Refused, match="RobotsDisallowed"):
        await RobotsCache(redis_client, fetch, TOKEN).check("http://huge.example/p1")
    stored = RobotsFile.from_json(await redis_client.get(robots_key("http://huge.example:80")))
    assert (stored.verdict, stored.body) == (DISALLOW_ALL, "")


def parsed_cost(body: str) -> int:
    tracemalloc.start()
    try:
        rules = Rules(RobotsFile(RULES, body), TOKEN)
        rules.allowed("http://h/a/x")
        return tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("rules", [1, 10, 100, 1000, 3000])
def test_the_size_estimate_follows_tracemalloc(rules):
    rng = random.Random(rules)
    body = "User-agent: polite-test-bot\n" + "".join(
        f"{rng.choice(['Allow', 'Disallow'])}: /{rng.choice(['img', 'w', 'search'])}/{i}"
        f"{rng.choice(['', '/', '*.php$', '/x'])}\n" for i in range(rules))
    estimate, measured = Rules(RobotsFile(RULES, body), TOKEN).size, parsed_cost(body)
    # Never much below what the parse costs; above it by a few KiB at most for small groups.
    assert 0.75 * measured <= estimate <= 1.5 * measured + 8192, (estimate, measured)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_memory_stays_within_its_budget_over_many_hosts(redis_client):
    body = "User-agent: *\n" + "".join(f"Disallow: /private/{i}/\n" for i in range(200))

    async def fetch(_origin: str) -> RobotsFile:
        return RobotsFile(RULES, body, 200)

    budget = 1 << 20
    cache = RobotsCache(redis_client, fetch, TOKEN, memory_bytes=budget)
    for i in range(300):
        await cache.check(f"http://host{i}.example/ok")
    held, nbytes = cache.memory_held()
    one = Rules(RobotsFile(RULES, body), TOKEN).size
    assert nbytes <= budget and held == budget // one
    assert cache.remembers("http://host299.example:80")  # the latest kept, the oldest gone
    assert not cache.remembers("http://host0.example:80")


def test_expired_entries_go_when_read_and_on_the_sweep():
    clock = Clock()
    cache: TtlCache[str, int] = TtlCache(clock, max_bytes=1000)
    cache.put("a", 1, ttl=10, size=100)
    cache.put("b", 2, ttl=500, size=100)
    clock.now += 11
    assert cache.get("a") is None and cache.nbytes == 100  # dropped when read
    cache.put("c", 3, ttl=10, size=100)
    clock.now += 100  # past the once-a-minute sweep, "c" expired unread
    cache.put("d", 4, ttl=10, size=100)
    assert len(cache) == 2 and cache.nbytes == 200
    cache.put("e", 5, ttl=10, size=2000)  # bigger than the whole budget: not kept
    assert cache.get("e") is None and cache.nbytes == 200


def test_least_recently_used_goes_first():
    cache: TtlCache[str, int] = TtlCache(Clock(), max_bytes=300)
    for key in "abc":
        cache.put(key, 0, ttl=10, size=100)
    cache.get("a")
    cache.put("d", 0, ttl=10, size=100)
    assert [k for k in "abcd" if cache.get(k) is not None] == ["a", "c", "d"]
