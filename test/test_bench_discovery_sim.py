"""The back-off's model sites: physics holds and a seed gives one answer."""
from __future__ import annotations

import asyncio

import pytest

from bench.discovery_sim import SITES, SLOW_SITES, crawl


@pytest.mark.parametrize("name, site", [("craftpics", SITES["craftpics"]),  # 2 slots of 186 ms: 10.75 req/s
                                        ("4-per-s", SLOW_SITES["4-per-s"])])  # 1 slot of 250 ms
def test_a_site_takes_at_least_its_urls_over_its_capacity_and_a_seed_repeats(name, site) -> None:
    first, again = (asyncio.run(crawl(name, site, seed=3, starved=6.0, on_time=0.6)) for _ in range(2))
    assert first.last_answer >= site.urls * site.service / (site.slots or site.urls)
    assert first.latency >= 1.0 and 3.2 <= first.top_grant <= 32.0
    assert (first.last_answer, first.latency, first.top_grant) == (again.last_answer, again.latency, again.top_grant)
