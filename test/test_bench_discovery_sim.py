"""The back-off's model sites: physics holds and a seed gives one answer."""
from __future__ import annotations

import asyncio

from bench.discovery_sim import SITES, crawl


def test_a_fragile_site_takes_at_least_its_urls_over_its_capacity_and_a_seed_repeats() -> None:
    site = SITES["craftpics"]  # 2 slots of 186 ms: 10.75 req/s
    first, again = (asyncio.run(crawl("craftpics", site, seed=3, starved=6.0, on_time=0.6)) for _ in range(2))
    assert first.last_answer >= site.urls * site.service / 2
    assert first.latency >= 1.0 and 3.2 <= first.top_grant <= 32.0
    assert (first.last_answer, first.latency, first.top_grant) == (again.last_answer, again.latency, again.top_grant)
