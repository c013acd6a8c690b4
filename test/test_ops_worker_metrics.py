"""A worker's /metrics (worker.metrics): every series filled by its hooks, served from the
server's own thread, and content to Prometheus's linter."""
from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import ConnectionError as RedisConnectionError

from worker import metrics
from worker.metrics import REGISTRY, MetricsServer, SchedulerLoad
from test.promtool import check_metrics, check_rules

ROOT = Path(__file__).resolve().parent.parent


def value(name: str, **labels: str) -> float:
    found = REGISTRY.get_sample_value(name, labels)
    assert found is not None, (name, labels)
    return found


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def test_infra_retries_are_counted_by_the_service_that_failed() -> None:
    before = {s: value("crawler_worker_infra_retries_total", service=s) for s in metrics.INFRA_SERVICES}
    metrics.infra_retry("kafka_send:image_metadata_updates", RuntimeError("queue full"))
    metrics.infra_retry("s3_put", OSError("refused"))
    metrics.infra_retry("redis_stats", RedisConnectionError("gone"))
    metrics.infra_retry("fetch_infrastructure", RedisConnectionError("gone"))
    metrics.infra_retry("fetch_infrastructure", MemoryError("no segment"))
    after = {s: value("crawler_worker_infra_retries_total", service=s) for s in metrics.INFRA_SERVICES}
    assert {s: after[s] - before[s] for s in after} == {"redis": 2, "kafka": 1, "s3": 1, "memory": 1}


async def test_image_pool_busy_time_counts_a_process_once_while_it_has_work() -> None:
    before = value("crawler_worker_image_pool_busy_seconds_total")
    process = object()

    async def image(seconds: float) -> None:
        with metrics.IMAGE_POOL.busy(process):
            await asyncio.sleep(seconds)

    first = asyncio.create_task(image(0.2))
    await asyncio.sleep(0.1)
    assert value("crawler_worker_image_pool_busy_processes") == 1
    await asyncio.gather(first, image(0.2))  # the second queued behind the first: 0.3 s in all
    busy = value("crawler_worker_image_pool_busy_seconds_total") - before
    assert 0.28 <= busy < 0.5, busy
    assert value("crawler_worker_image_pool_busy_processes") == 0


async def test_every_series_is_served_and_promtool_finds_nothing_to_warn_about() -> None:
    for kind in metrics.OUTCOME_KINDS:
        metrics.outcome(kind)
    metrics.FIRST_BYTE.observe(0.012)
    metrics.downloaded(0.3, 48_000)
    metrics.BODY_BUDGET.set(1 << 30)
    metrics.REBALANCE.joined("test_group")
    metrics.REBALANCE.assigned("test_group", 8)
    metrics.REBALANCE.revoked("test_group", 3)
    load = SchedulerLoad(waiting=7, in_flight={"reserved": 4, "shared": 2}, slots={"reserved": 20, "shared": 480})
    sampling = asyncio.create_task(metrics.sample_forever(lambda: load, lambda: 5 << 20, every=0.05))
    server = MetricsServer(0, host="127.0.0.1")
    try:
        await asyncio.sleep(0.1)
        text = await asyncio.to_thread(scrape, server.port)
    finally:
        sampling.cancel()
        server.close()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("crawler_worker_tasks_waiting", ())] == 7
    assert samples[("crawler_worker_tasks_in_flight", (("class", "shared"),))] == 2
    assert samples[("crawler_worker_slots", (("class", "reserved"),))] == 20
    assert samples[("crawler_worker_body_budget_used_bytes", ())] == 5 << 20
    assert samples[("crawler_worker_partitions", (("group", "test_group"),))] == 5
    assert samples[("crawler_worker_rebalances_total", (("group", "test_group"),))] == 1
    assert 0 <= samples[("crawler_worker_seconds_since_rebalance", (("group", "test_group"),))] < 5
    assert samples[("crawler_worker_first_byte_seconds_bucket", (("le", "0.025"),))] >= 1
    assert samples[("crawler_worker_download_seconds_count", ())] >= 1
    assert samples[("crawler_worker_downloaded_bytes_total", ())] >= 48_000
    assert samples[("crawler_worker_event_loop_lag_seconds", ())] < 1
    assert samples[("process_resident_memory_bytes", ())] > 0 and ("process_cpu_seconds_total", ()) in samples
    assert all(samples[("crawler_worker_outcomes_total", (("kind", k),))] >= 1 for k in metrics.OUTCOME_KINDS)
    check_metrics(text)


def test_a_port_already_taken_stops_the_worker_with_one_line() -> None:
    server = MetricsServer(0, host="127.0.0.1")
    try:
        with pytest.raises(SystemExit, match=f"WORKER_METRICS_PORT={server.port}: cannot serve"):
            MetricsServer(server.port, host="127.0.0.1")
    finally:
        server.close()


def served_names() -> set[str]:
    """Every crawler_* metric name the worker and the monitor serve, as scraped."""
    from crawl_monitor.http_api import render_metrics
    from crawl_monitor.source_state import SourceState
    state = SourceState(requests=1, rate_limit=2.0, override=3.0, tokens=1, ceiling=3.0, baseline_ms=100.0,
                        recent_ms=120.0, errors={"500": 1})
    texts = [render_metrics({"s": state}).decode(), generate_latest(REGISTRY).decode()]
    return {family.name + ("_total" if family.type == "counter" else "")
            for text in texts for family in text_string_to_metric_families(text)
            if family.name.startswith("crawler_")}


def test_the_readme_table_and_spec_name_every_metric_served_and_no_other() -> None:
    served = served_names()
    readme = (ROOT / "README.md").read_text()
    table = {name for line in readme.splitlines() if line.startswith("| `crawler_")
             for name in re.findall(r"`(crawler_\w+)`", line.split(" | ")[0])}
    spec = (ROOT / "SPEC.md").read_text().split("## 6.")[1].split("Removed")[0]
    in_spec = set(re.findall(r"`(crawler_\w+)`", spec))
    assert table == served, (sorted(served - table), sorted(table - served))
    assert in_spec == served, (sorted(served - in_spec), sorted(in_spec - served))


def test_the_readme_queries_are_promql_that_promtool_accepts(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    queries = [re.sub(r"^#.*\n", "", block, flags=re.MULTILINE).strip()
               for block in re.findall(r"```promql\n(.*?)```", readme, re.DOTALL)]
    assert len(queries) == 3
    served = served_names()
    for query in queries:
        used = set(re.findall(r"\bcrawler_\w+", query))
        assert used and used <= served, used - served
    rules = {"groups": [{"name": "readme", "rules": [{"record": f"readme:query{n}", "expr": query}
                                                      for n, query in enumerate(queries)]}]}
    path = tmp_path / "readme_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    check_rules(path)
