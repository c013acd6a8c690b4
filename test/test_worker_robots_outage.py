"""robots.txt outages delay, they do not end: ``python -m worker`` on the real servers,
judged by its outcomes and by what the sites received."""
from __future__ import annotations

import socket

from common.contracts import CRAWL_ERRORS_TOPIC, METADATA_TOPIC
from test.sites import Page, Site
from test.test_worker_integration import (Outcomes, ensure_crawl_topics, monitor_stand_in, produce,  # noqa: F401
                                          stop_cleanly, workers)
from test.worker_fakes import image_bytes

PHOTO = image_bytes("JPEG", (64, 48))
ALLOW = "User-agent: *\nDisallow: /private/\n"


WORKERS = 3
DOWN, HEALTHY, MISSING, REFUSED = (f"127.0.0.{n}" for n in (11, 12, 13, 14))  # a host each: a per-host cap each


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]  # closed again: connections to it are refused until a site takes it


def image_site(robots: Page, host: str, port: int = 0) -> Site:
    return Site({"/robots.txt": robots}, default=Page(body=PHOTO, headers={"Content-Type": "image/jpeg"}),
                port=port, host=host)


async def test_urls_wait_out_a_robots_txt_outage_and_are_crawled(workers, redis_client, kafka_hosts, unique):
    """503 for a while, then no connection for a while, then both answer: every URL succeeds,
    none is disallowed, and a healthy host's URLs are crawled meanwhile; a 404 allows all.
    Three workers share the hosts: robots.txt is still asked for once per try, cluster-wide."""
    source = f"rout{unique}"
    refused_port = free_port(REFUSED)
    async with image_site(Page(503), DOWN) as down, image_site(Page(body=ALLOW), HEALTHY) as healthy, \
            image_site(Page(404), MISSING) as missing:
        plan = {f"{name}-{unique}-{i}": f"{base}/img/{i}.jpg"
                for name, base in [("down", down.url), ("healthy", healthy.url), ("missing", missing.url),
                                   ("refused", f"http://{REFUSED}:{refused_port}")] for i in range(3)}
        messages = [{"url": url, "uuid": uuid, "source": source} for uuid, url in plan.items()]
        ensure_crawl_topics(kafka_hosts)
        outcomes = Outcomes(kafka_hosts, f"test-{unique}", set(plan))
        await outcomes.start()
        async with monitor_stand_in(redis_client, source, rate=20):
            await produce(kafka_hosts, source, messages)
            crew = [workers(MAX_TASKS="20") for _ in range(WORKERS)]
            worker = crew[0]
            await outcomes.wait_for(lambda o: len(o.terminal()) >= 6 and down.paths().count("/robots.txt") >= 1,
                                    timeout=90, worker=worker)
            crawled_meanwhile = set(outcomes.terminal())
            down.pages["/robots.txt"] = Page(body=ALLOW)  # back; the retry comes 30 s after the failure
            async with image_site(Page(body=ALLOW), REFUSED, port=refused_port) as back:
                await outcomes.wait_for(lambda o: len(o.terminal()) == len(plan), timeout=150, worker=worker)
            for member in crew:
                assert member.process.poll() is None, member.log()
                await stop_cleanly(member)
        await outcomes.close()
    assert {u for u in plan if u.startswith(("healthy", "missing"))} <= crawled_meanwhile
    assert not crawled_meanwhile & {u for u in plan if u.startswith(("down", "refused"))}
    assert set(outcomes.terminal().values()) == {METADATA_TOPIC}, outcomes.by_topic[CRAWL_ERRORS_TOPIC]
    assert down.paths().count("/robots.txt") == 2 and len(down.times("/img/")) == 3
    assert back.paths().count("/robots.txt") == 1 and len(back.times("/img/")) == 3
    assert down.times("/img/")[0] > down.times("/robots.txt")[1]


async def test_urls_end_as_robots_unavailable_after_the_give_up(workers, redis_client, kafka_hosts, unique):
    source = f"rgive{unique}"
    async with image_site(Page(503), DOWN) as down:
        plan = {f"gone-{unique}-{i}": f"{down.url}/img/{i}.jpg" for i in range(3)}
        ensure_crawl_topics(kafka_hosts)
        outcomes = Outcomes(kafka_hosts, f"test-{unique}", set(plan))
        await outcomes.start()
        async with monitor_stand_in(redis_client, source, rate=20):
            await produce(kafka_hosts, source, [{"url": u, "uuid": k, "source": source} for k, u in plan.items()])
            worker = workers(MAX_TASKS="20", ROBOTS_UNAVAILABLE_GIVE_UP="3")
            await outcomes.wait_for(lambda o: len(o.terminal()) == len(plan), timeout=90, worker=worker)
            await stop_cleanly(worker)
        await outcomes.close()
    errors = outcomes.by_topic[CRAWL_ERRORS_TOPIC]
    assert sorted(e["identifier"] for e in errors) == sorted(plan)
    assert {e["reason"] for e in errors} == {"RobotsUnavailable"}
    assert down.paths() == ["/robots.txt"]  # no image was asked for
