"""The whole system on the real stack, judged from the outside.

2,000 URLs over 20 simulated sources (limits from 1 to 200 req/s, 500s, 429s,
robots.txt rules, a Crawl-delay, dead links, broken files) go through
``python -m url_lists.tsv_producer`` to a monitor and two workers, all
subprocesses. The verdict comes from the outputs a downstream consumer sees
(Kafka topics, S3) and from the websites' own request logs. A quarter of the way
through, the monitor's and a worker's /metrics are scraped and linted by promtool.
"""
from __future__ import annotations

import asyncio
import io
import random
import time
import urllib.request
from pathlib import Path

import botocore.session
import pytest
from PIL import Image

from prometheus_client.parser import text_string_to_metric_families

from common.contracts import EVENT_HTTP_API_STARTED, EVENT_WORKER_METRICS_STARTED, WORKER_GROUP
from common.settings import DEFAULT_USER_AGENT, Settings
from demo.crawl import crawl
from demo.outcomes import QUALITY, Outcomes
from devstack.servers import DEV_CREDENTIALS, kafka_server
from test.conftest import BUCKET
from test.kafka_locate import locate
from test.promtool import check_metrics
from demo.simweb import Planned, SimWeb, SiteSpec, image_size, spec_rate, standard_web

N_SOURCES, N_URLS, WORKERS = 20, 2000, 2
CRAWL_TIMEOUT = 240.0
SETTINGS = Settings()


@pytest.fixture
def crawl_env(stack_env: dict[str, str], tmp_path: Path):
    """The stack's settings with a Kafka (tansu) of this test's own.

    Every worker joins one consumer group (``image_crawler_workers``); on tansu 0.6 a group
    whose members all left and new ones join is intermittently never rebalanced (0 messages
    in 40 s; a fresh group name never stalls), so each crawl gets a fresh broker. tansu keeps
    its data in memory and starts in well under a second.
    """
    server, hosts = kafka_server(tmp_path / "kafka")
    server.start()
    try:
        server.wait_ready()
        yield {**stack_env, "KAFKA_HOSTS": hosts}
    finally:
        server.stop()


def fail_if_dead(cluster):
    def check(_new: int) -> None:
        dead = cluster.died()
        assert not dead, f"{dead[0].name} died: see {dead[0].log_path}"
    return check


def outcome_report(outcomes: Outcomes, plan: list[Planned]) -> str:
    by_source: dict[str, int] = {}
    for item in plan:
        if item.uuid in outcomes.missing():
            by_source[item.source] = by_source.get(item.source, 0) + 1
    return f"{len(outcomes.missing())} uuids without an outcome, by source: {by_source}"


def missing_report(outcomes: Outcomes, plan: list[Planned], web: SimWeb, kafka_hosts: str) -> str:
    """Where the first few URLs without an outcome got to: what their sites logged, and whether a
    second reader of the outcome topics finds an outcome (the first reader missed it) or not
    (no worker sent one); any hole in the offsets the first reader got; and where the last
    message of each is (``test.kafka_locate``: a retry, a queue, a wait topic)."""
    missing = [p for p in plan if p.uuid in outcomes.missing()][:5]
    with Outcomes(kafka_hosts, [p.uuid for p in missing]) as again:
        again.wait(20)
    lines = [f"{p.source} {p.path} {p.uuid}: site log "
             f"{[(round(r.time, 3), r.status) for r in web.sites[p.source.lower()].log if r.path == p.path]}, "
             f"a second reader finds {dict(again.kinds.get(p.uuid, {})) or 'no outcome'}" for p in missing]
    return "\n".join([*lines, f"offset gaps seen by the first reader: {outcomes.gaps}",
                      f"where all {len(outcomes.missing())} are: {locate(kafka_hosts, outcomes.missing())}"])


def assert_outcomes(outcomes: Outcomes, plan: list[Planned], web: SimWeb | None = None,
                    kafka_hosts: str | None = None) -> None:
    """Exactly one terminal kind per uuid, and the kind the path calls for."""
    if not outcomes.done and web is not None and kafka_hosts is not None:
        raise AssertionError(f"{outcome_report(outcomes, plan)}\n{missing_report(outcomes, plan, web, kafka_hosts)}")
    assert outcomes.done, outcome_report(outcomes, plan)
    assert not outcomes.conflicts(), f"uuids with two terminal kinds: {outcomes.conflicts()}"
    wrong = [(p.source, p.path, outcomes.kind_of(p.uuid)) for p in plan if outcomes.kind_of(p.uuid) not in p.expect]
    assert not wrong, f"{len(wrong)} unexpected outcomes, e.g. {wrong[:5]}"


def assert_quality_messages(outcomes: Outcomes, plan: list[Planned], web: SimWeb) -> None:
    """Real dimensions (not swapped), bytes downloaded, a JPEG quality only for JPEGs."""
    by_uuid = {p.uuid: p for p in plan}
    for message in outcomes.messages["image_metadata_updates"]:
        if "width" not in message:
            continue
        item = by_uuid[message["identifier"]]
        assert (message["width"], message["height"]) == image_size(item.path), (item.path, message)
        body = web.sites[item.source.lower()].spec.files[item.path]
        assert message["filesize"] == len(body), (item.path, message)
        is_jpeg = item.path.endswith(".jpg")
        assert (isinstance(message["compression_quality"], int)) == is_jpeg, (item.path, message)


def assert_thumbnails(s3_endpoint: str, uuids: list[str]) -> None:
    client = botocore.session.get_session().create_client("s3", endpoint_url=s3_endpoint, **DEV_CREDENTIALS)
    keys: set[str] = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        keys.update(obj["Key"] for obj in page.get("Contents", []))
    missing = [u for u in uuids if f"{u}.jpg" not in keys]
    assert not missing, f"{len(missing)} successes without a thumbnail in S3, e.g. {missing[:3]}"
    for uuid in random.Random(0).sample(uuids, min(10, len(uuids))):
        body = client.get_object(Bucket=BUCKET, Key=f"{uuid}.jpg")["Body"].read()
        with Image.open(io.BytesIO(body)) as thumb:
            assert thumb.format == "JPEG" and max(thumb.size) <= SETTINGS.target_resolution


def assert_polite(web: SimWeb, workers: int, **kwargs) -> None:
    """No site saw more than its SPEC.md §3 rate, a robots.txt breach, a wrong User-Agent..."""
    violations = [v for site in web.sites.values()
                  for v in site.violations(spec_rate(site.spec.image_count), DEFAULT_USER_AGENT,
                                           SETTINGS.crawl_per_host_connections * workers, **kwargs)]
    assert not violations, "impolite, as the sites logged it:\n" + "\n".join(violations)


async def test_sites_log_when_a_request_arrived_not_when_they_got_to_it() -> None:
    """The verdict rests on these times: a site whose loop is held up (by the crawl's CPU use
    on a small machine) must not log the requests that waited as one burst."""
    web = SimWeb([SiteSpec("stamped", 100, {"/a": b"x"})])
    await web.start()
    sent: list[float] = []

    def request_soon() -> None:
        time.sleep(0.05)
        sent.append(time.time())
        urllib.request.urlopen(web.sites["stamped"].url("/a"), timeout=10).read()

    try:
        for _ in range(3):
            answered = asyncio.create_task(asyncio.to_thread(request_soon))
            await asyncio.sleep(0)  # the thread starts
            time.sleep(0.3)         # ... while this loop, the site's, is busy
            await answered
    finally:
        await web.stop()
    logged = [record.time for record in web.sites["stamped"].log]
    assert len(logged) == 3, (logged, sent)
    assert all(abs(at - when) < 0.05 for at, when in zip(logged, sent, strict=True)), (logged, sent)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200, url
        return response.read().decode()


def assert_metrics_mid_crawl(cluster) -> None:
    """Both /metrics endpoints as Prometheus scrapes them mid-crawl: promtool has no warning,
    the monitor has each source's limit and granted rate, and a worker shows its tasks,
    partitions, rebalance and downloads. On the local stack both listen on this machine only."""
    started = time.monotonic()
    started_events = {child.name: child.logged(event, 30)  # each on a free port of its own
                      for child, event in ((cluster.children[0], EVENT_HTTP_API_STARTED),
                                           (cluster.children[1], EVENT_WORKER_METRICS_STARTED))}
    assert {event["host"] for event in started_events.values()} == {"127.0.0.1"}
    ports = {name: event["port"] for name, event in started_events.items()}
    monitor = scrape(f"http://127.0.0.1:{ports['monitor']}/metrics")
    check_metrics(monitor)
    assert "crawler_source_limit_requests_per_second{" in monitor
    assert "crawler_source_granted_requests_per_second{" in monitor
    text = scrape(f"http://127.0.0.1:{ports['worker-1']}/metrics")
    check_metrics(text)
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("group", WORKER_GROUP) == WORKER_GROUP:  # not the robots wait line's
                samples[sample.name] = samples.get(sample.name, 0.0) + sample.value  # summed over labels
    print(f"\n[e2e] worker-1 mid-crawl: {samples['crawler_worker_tasks_in_flight']:.0f} tasks in flight, "
          f"{samples['crawler_worker_tasks_waiting']:.0f} waiting, {samples['crawler_worker_partitions']:.0f} "
          f"partitions, {samples['crawler_worker_download_seconds_count']:.0f} downloads; both endpoints "
          f"scraped and linted in {time.monotonic() - started:.2f} s")
    assert samples["crawler_worker_tasks_in_flight"] + samples["crawler_worker_tasks_waiting"] > 0
    assert samples["crawler_worker_slots"] == SETTINGS.max_tasks
    assert samples["crawler_worker_partitions"] > 0 and samples["crawler_worker_rebalances_total"] >= 1
    assert samples["crawler_worker_first_byte_seconds_count"] > 0
    assert samples["crawler_worker_download_seconds_count"] > 0 and samples["crawler_worker_downloaded_bytes_total"] > 0
    assert samples["crawler_worker_outcomes_total"] > 0 and samples["process_cpu_seconds_total"] > 0


def test_2000_urls_over_20_sources_each_get_one_outcome_politely(crawl_env, s3_endpoint, tmp_path: Path,
                                                                  unique: str) -> None:
    specs, plan = standard_web(N_SOURCES, N_URLS, prefix=f"e2e{unique[:6]}s")
    web = SimWeb(specs, log_path=tmp_path / "requests.jsonl")  # the sites' log, kept for a failure
    started = time.monotonic()
    with crawl(web, plan, crawl_env, tmp_path, WORKERS, WORKER_METRICS_PORT="0") as (cluster, outcomes):
        outcomes.wait(CRAWL_TIMEOUT, fail_if_dead(cluster), until=N_URLS // 4)
        assert_metrics_mid_crawl(cluster)
        outcomes.wait(CRAWL_TIMEOUT - (time.monotonic() - started), fail_if_dead(cluster))
        crawled = time.monotonic() - started
        codes = cluster.stop()
    print(f"\n[e2e] {N_URLS} URLs, {N_SOURCES} sources: every outcome in {crawled:.0f} s; "
          f"totals {dict(outcomes.totals())}, duplicates {outcomes.duplicates()}")
    assert_outcomes(outcomes, plan, web, crawl_env["KAFKA_HOSTS"])
    assert_quality_messages(outcomes, plan, web)
    assert_thumbnails(s3_endpoint, [u for u in outcomes.kinds if outcomes.kind_of(u) == QUALITY])
    assert_polite(web, WORKERS)
    assert set(codes.values()) == {0}, f"unclean exits on SIGTERM: {codes}"
