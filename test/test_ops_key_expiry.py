"""Issue 26: a crawl of millions of sites must not keep state for each of them forever. Every
per-source key but the counters (and an operator's settings) expires within 12 hours of the
source's last request: the real code writes what it writes for a source, on the real Redis,
and every key naming the source is read back with its TTL."""
from __future__ import annotations

import time

from common import contracts as c
from crawl_monitor.adaptive import Adaptation
from crawl_monitor.circuit_breaker import CircuitBreaker
from crawl_monitor.ctl import build_parser, run
from crawl_monitor.monitoring import MonitoringLog
from crawl_monitor.regulator import Regulator
from worker.politeness.crawl_delay import CrawlDelay
from worker.politeness.retry_after import extend_pause
from worker.outcomes.stats import Stats
from worker.fetching.tokens import TokenBuckets


def counters(source: str) -> set[str]:
    """What a source has counted: kept for the crawl's record (SPEC.md §2), never expiring.
    ``error_statuses`` names the status counters, so it lives as long as they do."""
    statuses = ("500", "404", "Timeout", "ForbiddenAddress")
    return {c.resized_key(source), c.errors_key(source), c.source_requests_key(source), c.urls_split_key(source),
            c.urls_ended_key(source), c.error_statuses_key(source),
            *(c.errors_key(source, status) for status in statuses)}


def operator_settings(source: str) -> set[str]:
    return {c.override_rate_key(source), c.adaptive_off_key(source)}


async def test_every_per_source_key_but_the_counters_expires_within_12_hours(redis_client, unique) -> None:
    source = f"expiry{unique}"
    redis = redis_client
    await redis.sadd(c.INBOUND_SOURCES, source)
    await redis.incrby(c.urls_split_key(source), 5)  # as the splitter counts them
    stats = Stats(redis)
    # A worker's outcomes: a success, link rot, a retry, an error kept out of the windows.
    await stats.record(source, "200", success=True, ttfb=0.05, terminal=True)
    await stats.record(source, "404", success=False, ttfb=0.02, terminal=True)
    await stats.record(source, "Timeout", success=False, terminal=False)
    await stats.record(source, "ForbiddenAddress", success=False, windows=False, terminal=True)
    # The monitor's second: an override, buckets, rates, the adaptive state, the breaker's check.
    await run(build_parser().parse_args(["override", source, "40"]), redis)
    await run(build_parser().parse_args(["adaptive", source, "off"]), redis)
    await run(build_parser().parse_args(["adaptive", source, "on"]), redis)
    adaptation = Adaptation(redis)
    regulator = Regulator(redis, adaptation)
    now = time.time()
    assert (await regulator.tick(now))[source] > 0
    await adaptation.update()
    await CircuitBreaker(redis).check(now)
    await MonitoringLog(redis).update()
    # A worker's request: its token, pace and send log; a Crawl-delay turn; a Retry-After; a token
    # taken after the bucket expired (no bucket: no key may be left behind).
    tokens = TokenBuckets(redis)
    assert await tokens.take(source)
    async with CrawlDelay(redis).turn(f"http://{source}.example", 0.5):
        pass
    await run(build_parser().parse_args(["halt", source]), redis)
    assert 0 < await redis.pttl(c.tokens_key(source)) <= 1500  # emptied as the regulator would
    await run(build_parser().parse_args(["resume", source]), redis)
    await stats.record(source, "500", success=False, ttfb=0.3, terminal=True)
    await extend_pause(redis, source, 30, time.time())
    await redis.delete(c.tokens_key(source))  # expired: the monitor stopped ticking it
    assert not await tokens.take(source)
    assert not await redis.exists(c.tokens_key(source))

    keys = {key async for key in redis.scan_iter(match=f"*{source}*")}
    ttls = {key: await redis.ttl(key) for key in keys}
    kept = {key for key, ttl in ttls.items() if ttl < 0}
    assert kept == (counters(source) & keys) | {c.override_rate_key(source)}, ttls
    assert all(0 < ttl <= c.SOURCE_STATE_TTL_SECONDS for key, ttl in ttls.items() if key not in kept), ttls
    # What the test wrote: every kind of per-source state (a missing one would pass unseen).
    expiring = {key.split(":")[0] for key in keys - kept}
    assert expiring >= {"rate_limit", "adaptive", "status60s", "status1hr", "status12hr",
                        "statuslast50req", "response_ms", "send_pace", "sent_log", "crawl_delay_next",
                        "retry_after"}, expiring
    assert not keys & operator_settings(source) - {c.override_rate_key(source)}  # adaptive on deleted it
