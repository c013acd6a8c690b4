"""The monitor's HTTP server against the real Redis: /metrics, /status, the dashboard files."""
from __future__ import annotations

import asyncio
import json
import re
import time
from contextlib import asynccontextmanager
from typing import Any
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from common import contracts as c
from common.contracts import utc_now_iso
from crawl_monitor.http_api import History, SourceState, start_http_api
from test.promtool import check_metrics


async def seed(redis) -> None:
    """Three sources in the states an operator meets: healthy, paused, halted."""
    await redis.sadd(c.INBOUND_SOURCES, "flickr", "animaldiversity", "phylopic")
    await redis.sadd(c.HALTED, "phylopic")
    await redis.sadd(c.TEMP_HALTED, "animaldiversity")
    await redis.mset({
        c.source_requests_key("flickr"): 13250, c.resized_key("flickr"): 13188,
        c.errors_key("flickr", "500"): 20, c.errors_key("flickr", "Timeout"): 2,
        c.rate_limit_key("flickr"): 178.375, c.tokens_key("flickr"): 120,
        c.source_requests_key("animaldiversity"): 40, c.resized_key("animaldiversity"): 18,
        c.errors_key("animaldiversity", "503"): 22, c.rate_limit_key("animaldiversity"): 0.5,
        c.override_rate_key("animaldiversity"): 0.5, c.tokens_key("animaldiversity"): 0,
        c.source_requests_key("phylopic"): 68, c.resized_key("phylopic"): 18,
        c.errors_key("phylopic", "500"): 50, c.rate_limit_key("phylopic"): 0.2,
        c.tokens_key("phylopic"): 0,
        c.errors_key("flickr"): 22,  # the per-source total is not a status
        c.errors_key("retired", "500"): 9,  # nor is a source no longer in inbound_sources
    })
    # flickr discovered its capacity past its size's 120 req/s (DISCOVERY_SOURCES=all) and the back-off
    # then slowed it below the ceiling; an operator switched the back-off off for phylopic.
    await redis.hset(c.adaptive_key("flickr"), mapping={"limit": 120, "ceiling": 200, "effective_rate": 178.375,
                                                         "baseline_ms": 210.4, "recent_ms": 450.2})
    await redis.set(c.adaptive_off_key("phylopic"), 1)
    # As workers write them beside each status counter: which counters exist.
    for source, statuses in {"flickr": ("500", "Timeout"), "animaldiversity": ("503",),
                             "phylopic": ("500",), "retired": ("500",)}.items():
        await redis.sadd(c.error_statuses_key(source), *statuses)
    # The backlogs (issue 26): flickr has 6,790 URLs to go, halted phylopic 9,932 waiting; animaldiversity
    # ended more than it was split (URLs ended twice, at-least-once), which is no backlog.
    await redis.mset({c.urls_split_key("flickr"): 20_000, c.urls_ended_key("flickr"): 13_210,
                      c.urls_split_key("phylopic"): 10_000, c.urls_ended_key("phylopic"): 68,
                      c.urls_split_key("animaldiversity"): 40, c.urls_ended_key("animaldiversity"): 41})
    # Opt-outs (issue 45), as workers count them per signal.
    await redis.hset(c.opted_out_key("flickr"), mapping={"tdmrep-file": 12, "x-robots-tag": 3})
    # Each was crawled just now: the monitor's per-second work covers the sources active lately.
    await redis.zadd(c.ACTIVE_SOURCES, dict.fromkeys(("flickr", "animaldiversity", "phylopic"), time.time()))


def monitoring_update() -> dict[str, Any]:
    """A monitoring_update as the monitor logs it (SPEC.md §4)."""
    return {
        "event": c.EVENT_MONITORING_UPDATE, "time": utc_now_iso(),
        "general": {"global_max_rps": 179.075, "error_rps": 0.4, "processing_rate": 42.7,
                    "success_rps": 42.3, "circuit_breaker_tripped": ["phylopic"], "num_resized": 13224,
                    "resize_errors": 94, "split_rate": 12.5},
        "specific": {
            "flickr": {"successful": 13188, "error": 22, "rate_limit": 178.375,
                       "last_50_statuses": {"200": 48, "500": 2}},
            "animaldiversity": {"successful": 18, "error": 22, "rate_limit": 0.5,
                                "last_50_statuses": {"200": 18, "503": 22}},
            "phylopic": {"successful": 18, "error": 50, "rate_limit": 0.2,
                         "last_50_statuses": {"500": 50}},
        },
    }


@asynccontextmanager
async def serve(redis, latest: Callable[[], Any], sample_every: float = 5.0) -> AsyncIterator[str]:
    runner = await start_http_api(0, redis, latest, host="127.0.0.1", sample_every=sample_every)
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()


async def test_metrics_expose_every_source_from_redis(redis_client) -> None:
    await seed(redis_client)
    async with serve(redis_client, monitoring_update) as base:
        status, text = await get(f"{base}/metrics")
    assert status == 200
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def value(name: str, source: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"source": source, **labels}.items())))]

    assert value("crawler_source_requests_total", "flickr") == 13250
    assert value("crawler_source_successes_total", "flickr") == 13188
    assert value("crawler_source_errors_total", "flickr", status="500") == 20
    assert value("crawler_source_errors_total", "flickr", status="Timeout") == 2
    assert value("crawler_source_errors_total", "phylopic", status="500") == 50
    assert value("crawler_source_granted_requests_per_second", "flickr") == 178.375
    assert value("crawler_source_limit_requests_per_second", "flickr") == 120  # adaptive:flickr limit
    assert value("crawler_source_ceiling_requests_per_second", "flickr") == 200  # its discovery ceiling
    assert value("crawler_source_limit_requests_per_second", "animaldiversity") == 0.5  # its override
    assert value("crawler_source_ceiling_requests_per_second", "animaldiversity") == 0.5
    assert ("crawler_source_limit_requests_per_second", (("source", "phylopic"),)) not in samples  # not yet known
    assert value("crawler_source_tokens", "flickr") == 120
    assert [value("crawler_source_halted", s) for s in ("flickr", "animaldiversity", "phylopic")] == [0, 0, 1]
    assert [value("crawler_source_temp_halted", s) for s in ("flickr", "animaldiversity", "phylopic")] == [0, 1, 0]
    error_statuses = {dict(k[1])["status"] for k in samples if k[0] == "crawler_source_errors_total"}
    assert error_statuses == {"500", "Timeout", "503"}
    assert not any(dict(k[1]).get("source") == "retired" for k in samples)
    assert value("crawler_source_response_seconds", "flickr", window="baseline") == pytest.approx(0.2104)
    assert value("crawler_source_response_seconds", "flickr", window="recent") == pytest.approx(0.4502)
    assert [value("crawler_source_adaptive", s) for s in ("flickr", "animaldiversity", "phylopic")] == [1, 1, 0]
    assert ("crawler_source_response_seconds", (("source", "animaldiversity"), ("window", "recent"))) not in samples
    assert samples[("process_resident_memory_bytes", ())] > 0  # the monitor's own
    # SPEC.md §6: the names with abbreviated units are gone, and Prometheus's linter is content.
    assert not re.search(r"_ms\b|_rps\b", text)
    check_metrics(text)
    assert [value("crawler_source_backlog", s) for s in ("flickr", "animaldiversity", "phylopic")] == [6790, 0, 9932]
    opted = {dict(k[1])["signal"]: v for k, v in samples.items()
             if k[0] == "crawler_source_opted_out_total" and dict(k[1])["source"] == "flickr"}
    assert opted == {"tdmrep-file": 12, "x-robots-tag": 3}


async def test_metrics_and_status_show_the_active_and_stopped_sources_and_count_the_rest(redis_client) -> None:
    """Issue 26: reading every source seen took 15 s a scrape at 100,000 sources."""
    await seed(redis_client)
    await redis_client.sadd(c.INBOUND_SOURCES, "quiet", "gone")
    await redis_client.set(c.resized_key("quiet"), 5)
    await redis_client.zadd(c.ACTIVE_SOURCES, {"quiet": time.time() - 3600})  # crawled an hour ago
    async with serve(redis_client, monitoring_update) as base:
        _, text = await get(f"{base}/metrics")
        _, status = await get(f"{base}/status")
    sources = {s.labels["source"] for family in text_string_to_metric_families(text) for s in family.samples
               if "source" in s.labels}
    assert sources == {"flickr", "animaldiversity", "phylopic"}
    body = json.loads(status)
    assert set(body["sources"]) == {"flickr", "animaldiversity", "phylopic"} and body["sources_omitted"] == 2


async def test_metrics_answer_503_when_redis_is_down() -> None:
    dead = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    try:
        async with serve(dead, lambda: None) as base:
            status, text = await get(f"{base}/metrics")
            status_code, _ = await get(f"{base}/status")
    finally:
        await dead.aclose()
    assert status == 503 and "Redis" in text
    assert status_code == 200  # the dashboard still shows the monitor's update and a banner


async def sample_times(session: aiohttp.ClientSession, base: str, since: float) -> list[float]:
    async with session.get(f"{base}/status", params={"since": str(since)}) as response:
        return [sample["time"] for sample in (await response.json())["history"]]


async def test_status_has_the_latest_update_live_sources_and_history(redis_client) -> None:
    await seed(redis_client)
    update = monitoring_update()
    async with serve(redis_client, lambda: update, sample_every=0.1) as base:
        await asyncio.sleep(0.25)
        await redis_client.incrby(c.source_requests_key("flickr"), 50)
        await asyncio.sleep(0.35)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/status") as response:
                body = await response.json()
            # The sampler keeps adding every 0.1 s: a later answer may hold newer samples, never older ones.
            first, last = body["history"][0]["time"], body["history"][-1]["time"]
            after_first = await sample_times(session, base, since=first)
            after_last = await sample_times(session, base, since=last)
            async with session.get(f"{base}/status", params={"since": "soon"}) as response:
                assert response.status == 400
    assert after_first and min(after_first) > first and all(t > last for t in after_last)
    assert {k: body[k] for k in ("event", "time", "general", "specific")} == update
    flickr = body["sources"]["flickr"]
    assert (flickr["requests"], flickr["successes"], flickr["errors"]) == (13300, 13188, {"500": 20, "Timeout": 2})
    assert (flickr["rate_limit"], flickr["tokens"], flickr["error_total"]) == (178.375, 120, 22)
    assert body["sources"]["phylopic"]["halted"] and body["sources"]["animaldiversity"]["temp_halted"]
    assert body["sources"]["animaldiversity"]["override"] == 0.5
    assert (flickr["limit"], flickr["ceiling"], flickr["effective_rate"], flickr["baseline_ms"], flickr["recent_ms"],
            flickr["adaptive"]) == (120, 200, 178.375, 210.4, 450.2, True)
    assert body["sources"]["phylopic"]["adaptive"] is False
    assert len(body["history"]) >= 3
    assert any((s["sources"]["flickr"]["rps"] or 0) > 0 for s in body["history"])
    assert body["history"][-1]["general"]["success_rps"] == 42.3


async def test_status_before_the_first_update_and_with_a_failing_callable(redis_client) -> None:
    await seed(redis_client)

    def broken() -> dict:
        raise RuntimeError("monitor not ready")

    for latest in (lambda: None, broken):
        async with serve(redis_client, latest) as base, aiohttp.ClientSession() as session:
            async with session.get(f"{base}/status") as response:
                body = await response.json()
        assert body["event"] is None and "general" not in body
        assert sorted(body["sources"]) == ["animaldiversity", "flickr", "phylopic"]


async def test_dashboard_files_are_served_from_the_package(redis_client) -> None:
    async with serve(redis_client, lambda: None) as base:
        status, html = await get(f"{base}/")
        js_status, js = await get(f"{base}/static/app.js")
        css_status, _ = await get(f"{base}/static/style.css")
    assert status == js_status == css_status == 200
    assert "/static/app.js" in html
    assert not re.search(r'(src|href)="(https?:)?//', html), "the dashboard must not load from a CDN"
    assert "fetch(`/status" in js


def test_history_computes_achieved_rates_and_keeps_one_hour() -> None:
    history = History(span=3600)
    t0 = time.time()
    history.add(t0, None, {"a": SourceState(requests=100, rate_limit=2.0)})
    sample = history.add(t0 + 5, monitoring_update(), {"a": SourceState(requests=110, rate_limit=2.0)})
    assert sample["sources"]["a"] == {"rps": 2.0, "rate_limit": 2.0}
    assert sample["general"]["success_rps"] == 42.3
    history.add(t0 + 10, None, None)  # Redis unreachable: the next rate spans the gap
    assert history.add(t0 + 15, None, {"a": SourceState(requests=130)})["sources"]["a"]["rps"] == 2.0
    assert history.achieved_rps("a") == 2.0
    history.add(t0 + 3700, None, {})
    assert [round(s["time"] - t0) for s in history.samples] == [3700]


async def test_reading_every_source_walks_no_keyspace(redis_client) -> None:
    """Its cost follows the sources, not every key (one robots.txt key per host, say)."""
    from crawl_monitor.source_state import read_sources
    await seed(redis_client)
    await redis_client.mset({f"robots:http://host{n}.example:80": "x" for n in range(2000)})
    await redis_client.config_resetstat()
    states = await read_sources(redis_client)
    assert states["flickr"].errors == {"500": 20, "Timeout": 2}
    commands = await redis_client.info("commandstats")
    assert not any(name.startswith(("cmdstat_scan", "cmdstat_keys")) for name in commands), sorted(commands)


def test_history_is_bounded_in_bytes_whatever_the_number_of_sources() -> None:
    """2,000 sources sampled every 5 s for an hour: the busiest 50 series, older samples thinned."""
    from crawl_monitor.http_api import HISTORY_SOURCES
    history = History(span=3600)
    t0 = time.time()
    sizes = []
    for step in range(721):
        sources = {f"s{n:04d}": SourceState(requests=step * (n % 97), rate_limit=1.0) for n in range(2000)}
        history.add(t0 + 5 * step, None, sources)
        if step in (360, 720):
            sizes.append(len(json.dumps(list(history.samples))))
    assert all(len(s["sources"]) <= HISTORY_SOURCES for s in history.samples)
    assert len(history.samples) <= 120 + 100 + 2  # 10 minutes in full, 50 at one per 30 s
    assert sizes[1] < 3_000_000 and sizes[1] < 1.5 * sizes[0], sizes  # levelled off, ~1 GiB before
    assert history.samples[-1]["requests_rps"] == pytest.approx(sum(n % 97 for n in range(2000)) / 5)
    assert history.achieved_rps("s0096") == 96 / 5  # every source's latest rate, busiest or not


async def test_the_chart_rereads_the_active_sources_each_sample_and_the_quiet_ones_each_minute(redis_client) -> None:
    """The sampler reads only what the chart shows (requests, the granted rate) and, between two full
    reads, only of the sources active since its last read: a quiet one keeps its last value, and a
    source that starts between them is added."""
    from crawl_monitor.constants import ACTIVE_SOURCES_FULL_READ_SECONDS
    from crawl_monitor.source_state import ChartReads
    await seed(redis_client)
    now = [time.time()]
    await redis_client.zadd(c.ACTIVE_SOURCES, {"animaldiversity": now[0] - 300})  # quiet for 5 minutes
    chart = ChartReads(redis_client, clock=lambda: now[0])
    assert await chart.sample() is None  # the first read is a full one
    shown = sorted(chart.states)
    assert {"flickr", "animaldiversity", "phylopic"} <= set(shown)
    assert chart.states["flickr"] == SourceState(requests=13250, rate_limit=178.375)
    assert chart.states["animaldiversity"] == SourceState(requests=40, rate_limit=0.5)
    for source in ("flickr", "animaldiversity", "newcomer"):
        await redis_client.incrby(c.source_requests_key(source), 10)
    now[0] += 5
    await redis_client.zadd(c.ACTIVE_SOURCES, {"flickr": now[0], "newcomer": now[0]})
    read = await chart.sample()
    assert read is not None and {"flickr", "newcomer"} <= read and "animaldiversity" not in read
    assert (chart.states["flickr"].requests, chart.states["animaldiversity"].requests) == (13260, 40)
    assert chart.states["newcomer"].requests == 10
    now[0] += ACTIVE_SOURCES_FULL_READ_SECONDS
    assert await chart.sample() is None
    assert (chart.states["flickr"].requests, chart.states["animaldiversity"].requests) == (13260, 50)
    await redis_client.delete(c.ACTIVE_SOURCES, c.WAITING_SOURCES, c.HALTED, c.TEMP_HALTED)
    now[0] += ACTIVE_SOURCES_FULL_READ_SECONDS
    assert await chart.sample() is None and chart.states == {}  # nothing shown any more: nothing kept


async def test_a_full_chart_read_asks_a_batch_of_sources_at_a_time(redis_client) -> None:
    """A full read of many sources goes to Redis in batches, each awaited: the monitor's loop, which
    refills the buckets, runs between them rather than waiting for the whole read."""
    from crawl_monitor.batched_keys import KEYS_BATCH
    from crawl_monitor.source_state import ChartReads
    now = time.time()
    sources = [f"many{i:05d}" for i in range(2 * KEYS_BATCH + 7)]
    async with redis_client.pipeline(transaction=False) as pipe:
        pipe.zadd(c.ACTIVE_SOURCES, {source: now for source in sources})
        pipe.mset({c.source_requests_key(source): i for i, source in enumerate(sources)})
        await pipe.execute()
    asked: list[int] = []

    class Client:  # the client, counting the keys of each MGET the reader asks
        async def mget(self, keys):
            asked.append(len(keys))
            return await redis_client.mget(keys)

        def __getattr__(self, name):
            return getattr(redis_client, name)

    chart = ChartReads(Client(), clock=lambda: now)  # type: ignore[arg-type]
    assert await chart.sample() is None
    assert max(asked) == KEYS_BATCH and sum(asked) == 2 * len(sources)  # requests and rates
    assert all(chart.states[source].requests == i for i, source in enumerate(sources))


def test_history_of_the_sources_read_counts_the_others_as_unmoved() -> None:
    """Given the sources read this sample, every other shown source's rate is 0 (its count has not
    moved), in the sum, the series and its achieved rate, as if it had been read."""
    history = History(span=3600)
    t0 = time.time()
    states = {f"s{n}": SourceState(requests=100, rate_limit=1.0) for n in range(3)}
    history.add(t0, None, states)
    states["s1"] = SourceState(requests=150, rate_limit=1.0)
    sample = history.add(t0 + 5, None, states, read={"s1"})
    assert sample["requests_rps"] == 10.0
    assert sample["sources"] == {"s0": {"rps": 0.0, "rate_limit": 1.0}, "s1": {"rps": 10.0, "rate_limit": 1.0},
                                 "s2": {"rps": 0.0, "rate_limit": 1.0}}
    assert (history.achieved_rps("s0"), history.achieved_rps("s1"), history.achieved_rps("unknown")) == (0.0, 10.0,
                                                                                                          None)
    states["s3"] = SourceState(requests=7)  # new: read, no rate yet
    assert history.add(t0 + 10, None, states, read={"s3"})["sources"]["s3"] == {"rps": None, "rate_limit": None}


async def test_past_the_most_shown_the_stopped_come_first_then_the_latest_active(redis_client) -> None:
    """/metrics and /status serve a bounded set however many sources were active in 10 minutes."""
    from crawl_monitor.source_state import shown_sources
    now = time.time()
    await redis_client.zadd(c.ACTIVE_SOURCES, {f"s{n}": now - 100 + n for n in range(6)} | {"old": now - 3600})
    await redis_client.zadd(c.WAITING_SOURCES, {"s0": now})  # waiting now: its latest activity
    await redis_client.sadd(c.HALTED, "halted-long-ago")
    assert await shown_sources(redis_client, now, 3) == ["halted-long-ago", "s0", "s5"]
    assert await shown_sources(redis_client, now) == ["halted-long-ago", *(f"s{n}" for n in range(6))]
