"""Never above the limit, as the sites see it: three worker-like processes race for the
tokens of sources from 0.2 to 200 req/s, each source on its own loopback address, with the
monitor's regulator refilling the buckets once a second; no site may see more than
floor(limit) + 1 requests in any sliding one-second window (README, "Politeness"), and the
sources must still get most of their budget."""
from __future__ import annotations

import asyncio
import json

import pytest

from common.contracts import INBOUND_SOURCES, override_rate_key
from bench.scheduler import tick_each_second
from crawl_monitor.regulator import Regulator
from common.contracts import allowed_per_second
from demo.simweb import SimWeb, SiteSpec, busiest_second
from test.sites import run_racing

pytestmark = pytest.mark.paced  # runs by itself, after the rest (pytest.ini)

PROCESSES = 3
SECONDS = 14.0
LATENCY = 0.02


async def regulate(redis_client, stop: asyncio.Event) -> None:
    """The monitor's regulator, ticking on the second as ``python -m crawl_monitor`` does."""
    regulator = Regulator(redis_client)
    await tick_each_second(regulator, stop)
    await regulator.empty_buckets()


async def run_crawlers(redis_url: str, plan: dict[str, str]) -> list[dict[str, dict[str, int]]]:
    argv = [redis_url, str(PROCESSES), str(SECONDS), json.dumps(plan)]
    return await run_racing("test.pacing_crawler", [argv] * PROCESSES, SECONDS + 60)


@pytest.mark.parametrize("rates", [(0.2, 0.5, 3.7, 20.0, 120.4), (1.0, 7.0, 200.0)],
                         ids=["0.2-120.4", "1-200"])
async def test_no_site_sees_more_than_floor_limit_plus_one_in_any_second(redis_client, redis_url, rates):
    names = [f"pace{i}" for i in range(len(rates))]
    limits = dict(zip(names, rates, strict=True))
    web = SimWeb([SiteSpec(name, 0, latency=LATENCY, host=f"127.0.0.{11 + i}") for i, name in enumerate(names)])
    await web.start()
    await redis_client.sadd(INBOUND_SOURCES, *names)
    for name, rate in limits.items():
        await redis_client.set(override_rate_key(name), rate)
    stop = asyncio.Event()
    regulator = asyncio.create_task(regulate(redis_client, stop))
    try:
        outcomes = await run_crawlers(redis_url, {name: web.sites[name].base_url for name in names})
    finally:
        stop.set()
        await regulator
        await web.stop()

    report, over, starved = [], [], []
    for name, limit in limits.items():
        times = sorted(r.time for r in web.sites[name].requests("/img/"))
        peak, at = busiest_second(times)
        sent = sum(o[name].get("404", 0) for o in outcomes)
        span = times[-1] - times[0] if len(times) > 1 else 0.0
        report.append(f"{name} limit {limit}: {len(times)} requests ({sent} answered), "
                      f"{(len(times) - 1) / span if span else 0:.2f}/s, busiest second {peak} "
                      f"(allowed {allowed_per_second(limit)})")
        if peak > allowed_per_second(limit):
            over.append(f"{name}: {peak} requests from {at - times[0]:.2f} s, limit {limit}")
        # Not polite by sending nothing: a third of the limit at least, give or take one request
        # (a slow source's first token comes up to 1/rate s after the start). On a quiet machine
        # sources get 96-100% (SEND_WINDOW_SECONDS caps 120.4/s at 115/s); with four CPU burners
        # beside the suite, as low as 48% (a loaded worker forfeits late tokens rather than bunch).
        if len(times) < limit * (SECONDS - 1.0) / 3 - 1:
            starved.append(f"{name}: {len(times)} requests in {SECONDS:.0f} s, limit {limit}")
    print("\n" + "\n".join(report))
    assert not over, "above floor(limit) + 1 in a second, as the sites logged it:\n" + "\n".join(over)
    assert not starved, "budget left unused:\n" + "\n".join(starved)
