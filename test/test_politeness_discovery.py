"""Capacity discovery judged from the websites' side (issue 41), on the real stack.

A list site (no size in SOURCES_URL: rated 1 req/s by DEFAULT_SOURCE_RATE) that can take
30 req/s (3 server slots of 0.1 s) and slows down past it, beside a catalog site of 5 req/s
that answers fast; a monitor and three workers crawl both, each site on a loopback address of
its own, with DISCOVERY_MAX_RATE=40. The list site is granted past its size's rate while it
answers at its unloaded speed, and held near its capacity: after half a minute its median
response is within 3x its unloaded time while it serves at least half its capacity, and no
second holds more than floor(40) + 1 of its requests. Saturated (40 req/s, 24 requests in
flight) it would answer in ~0.8 s. The catalog site keeps its size's rate as its ceiling.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest

from common.contracts import EVENT_MONITORING_UPDATE
from common.settings import DEFAULT_USER_AGENT, Settings
from demo.crawl import crawl
from demo.simweb import SimWeb, spec_rate
from test.test_e2e_crawl import crawl_env, fail_if_dead  # noqa: F401 - crawl_env is a fixture
from test.test_politeness_adaptive import served_after, site

pytestmark = pytest.mark.paced  # runs by itself, after the rest (pytest.ini)

WORKERS = 3
SERVICE_SECONDS, SLOTS, CEILING = 0.1, 3, 40.0
SETTLE_SECONDS, MEASURE_SECONDS = 30.0, 30.0
CATALOG_RATE, CATALOG_HOST, CATALOG_LATENCY = 5.0, "127.0.0.22", 0.02


class ListedWeb(SimWeb):
    """A simulated web whose SOURCES_URL file leaves out the sites of a URL list."""

    def __init__(self, specs, listed: set[str], log_path: Path):
        super().__init__(specs, log_path=log_path)
        self.listed = listed

    def write_sources(self, path: Path) -> Path:
        listing = [{"source_name": s.spec.name, "image_count": s.spec.image_count}
                   for s in self.sites.values() if s.spec.name not in self.listed]
        path.write_text(json.dumps(listing, indent=1))
        return path


def test_a_list_site_discovers_its_capacity_and_is_held_near_it(crawl_env, tmp_path: Path,  # noqa: F811
                                                                unique: str) -> None:
    listed_name, catalog_name = f"disc{unique[:6]}list", f"disc{unique[:6]}cat"
    total = SETTLE_SECONDS + MEASURE_SECONDS + 15
    listed, listed_plan = site(listed_name, 1.0, "127.0.0.21", int(total * 32), SERVICE_SECONDS, SLOTS)
    catalog, catalog_plan = site(catalog_name, CATALOG_RATE, CATALOG_HOST, int(total * CATALOG_RATE * 1.2),
                                 CATALOG_LATENCY)
    web = ListedWeb([listed, catalog], {listed_name}, tmp_path / "requests.jsonl")
    with crawl(web, listed_plan + catalog_plan, crawl_env, tmp_path, WORKERS, DEFAULT_SOURCE_RATE="1",
               DISCOVERY_MAX_RATE=str(CEILING)) as (cluster, _outcomes):
        fragile = web.sites[listed_name]
        check = fail_if_dead(cluster)
        deadline = time.monotonic() + 120
        while not fragile.log and time.monotonic() < deadline:
            check(0)
            time.sleep(0.5)
        assert fragile.log, "the list site got no request in 2 minutes"
        first = fragile.log[0].time
        while time.time() < first + SETTLE_SECONDS + MEASURE_SECONDS:
            check(0)
            time.sleep(1)
        cluster.stop()
    since, until = first + SETTLE_SECONDS, first + SETTLE_SECONDS + MEASURE_SECONDS
    window = served_after(fragile.log, since, until)
    median = statistics.median(r.served_in for r in window) if window else float("inf")
    rate = len(window) / MEASURE_SECONDS
    updates = [json.loads(line) for line in (tmp_path / "monitor.log").read_text().splitlines()
               if EVENT_MONITORING_UPDATE in line]
    last = {name: entry for update in updates for name, entry in update["specific"].items()}  # each one's latest
    granted = [u["specific"][listed_name]["rate_limit"] for u in updates if listed_name in u["specific"]]
    print(f"\n[discovery] list site after {SETTLE_SECONDS:.0f} s: median response {median:.3f} s "
          f"(unloaded {SERVICE_SECONDS} s), {rate:.1f} req/s served (capacity {SLOTS / SERVICE_SECONDS:.0f}); "
          f"grants seen {min(granted, default=0):.1f}-{max(granted, default=0):.1f}; "
          f"the monitor's last word: {last.get(listed_name)}; catalog site: {last.get(catalog_name)}")
    connections = Settings().crawl_per_host_connections * WORKERS
    violations = (fragile.violations(CEILING, DEFAULT_USER_AGENT, connections)
                  + web.sites[catalog_name].violations(spec_rate(catalog.image_count), DEFAULT_USER_AGENT,
                                                       connections))
    assert not violations, violations
    assert median <= 3 * SERVICE_SECONDS, f"median response {median:.3f} s, unloaded {SERVICE_SECONDS} s"
    assert rate >= 0.5 * SLOTS / SERVICE_SECONDS, f"{rate:.1f} req/s, capacity {SLOTS / SERVICE_SECONDS:.0f}"
    assert granted and max(granted) <= CEILING, granted
    # What the operator sees: why the list site is crawled past its size's 1 req/s.
    shown = last.get(listed_name)
    assert shown is not None and (shown["limit"], shown["ceiling"]) == (1.0, CEILING), shown
    kept = last.get(catalog_name)
    assert kept is not None and kept["ceiling"] == kept["limit"] == pytest.approx(CATALOG_RATE, rel=0.01), kept
