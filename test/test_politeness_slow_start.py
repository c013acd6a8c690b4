"""The adaptive back-off's slow start, judged from the websites' side (issue 28), on the real stack.

Three sources new to the monitor (20, 7.5 and 60 req/s), each on a loopback address of its
own, sites answering in 30 ms, a monitor and three workers. A site that answers as fast as
at first must get its whole limit within seconds: counted at the site from 10 s after the
source's first request, each achieves at least 90% of its limit. The slow start that
preceded it (a tenth of the limit, doubled per 10 judged answers) gave 71%, 51% and 90%.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from common.settings import DEFAULT_USER_AGENT, Settings
from demo.crawl import crawl
from demo.simweb import SimWeb, fetches, spec_rate
from test.test_e2e_crawl import crawl_env, fail_if_dead  # noqa: F401 - crawl_env is a fixture
from test.test_politeness_adaptive import site

pytestmark = pytest.mark.paced  # runs by itself, after the rest (pytest.ini)

WORKERS = 3
LATENCY = 0.03
RAMP_SECONDS, MEASURE_SECONDS = 10.0, 10.0
SOURCES = ((20.0, "127.0.0.21"), (7.5, "127.0.0.22"), (60.0, "127.0.0.23"))  # limit, host
SHARE = 0.9


def per_second(times: list[float], first: float, seconds: int) -> list[int]:
    counts = [0] * seconds
    for at in times:
        if 0 <= at - first < seconds:
            counts[int(at - first)] += 1
    return counts


def image_times(log) -> list[float]:
    """When the site's image requests came (its robots.txt and TDMRep file apart), in order."""
    return sorted(r.time for r in fetches(log))


def test_new_sources_reach_their_limits_within_seconds(crawl_env, tmp_path: Path, unique: str) -> None:  # noqa: F811
    names = [f"start{unique[:6]}s{i}" for i in range(len(SOURCES))]
    specs, plan = [], []
    for name, (limit, host) in zip(names, SOURCES, strict=True):
        # Enough URLs that no source runs out before its window ends.
        spec, planned = site(name, limit, host, int(limit * (RAMP_SECONDS + MEASURE_SECONDS + 8)), LATENCY)
        specs.append(spec), plan.extend(planned)
    web = SimWeb(specs, log_path=tmp_path / "requests.jsonl")
    with crawl(web, plan, crawl_env, tmp_path, WORKERS) as (cluster, _outcomes):
        check = fail_if_dead(cluster)
        deadline = time.monotonic() + 90
        while not all(image_times(web.sites[n].log) for n in names) and time.monotonic() < deadline:
            check(0)
            time.sleep(0.5)
        assert all(image_times(web.sites[n].log) for n in names), "a source got no image request in 90 s"
        # Measured from each source's first image request, not its robots.txt: stop after the last window.
        last_first = max(image_times(web.sites[n].log)[0] for n in names)
        while time.time() < last_first + RAMP_SECONDS + MEASURE_SECONDS:
            check(0)
            time.sleep(0.5)
        cluster.stop()
    shares, report = {}, []
    for name, (limit, _host) in zip(names, SOURCES, strict=True):
        times = image_times(web.sites[name].log)
        first = times[0]
        measured = [t for t in times if first + RAMP_SECONDS <= t < first + RAMP_SECONDS + MEASURE_SECONDS]
        shares[name] = len(measured) / MEASURE_SECONDS / limit
        report.append(f"{limit:g} req/s: {len(measured) / MEASURE_SECONDS:.1f} req/s ({shares[name]:.0%}) "
                      f"past {RAMP_SECONDS:.0f} s; per second "
                      f"{per_second(times, first, int(RAMP_SECONDS + MEASURE_SECONDS))}")
    print("\n[slow start] " + "\n[slow start] ".join(report))
    violations = [v for s in web.sites.values()
                  for v in s.violations(spec_rate(s.spec.image_count), DEFAULT_USER_AGENT,
                                        Settings().crawl_per_host_connections * WORKERS)]
    assert not violations, violations
    assert all(share >= SHARE for share in shares.values()), report
