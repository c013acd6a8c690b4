"""``make demo``: crawl a sample site on a local stack, then show what happened.

Starts Kafka, Redis and S3 (from wheels), a three-source sample site on
loopback, ``python -m crawl_monitor`` and two ``python -m worker``, schedules
the crawl with the TSV producer, follows the outcomes, prints a per-source
summary and leaves the results in ``out/``. Everything it starts is stopped
on the way out, on success, failure, Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

from tqdm import tqdm

from common.contracts import EVENT_DEMO_INTERRUPTED, EVENT_WORKER_METRICS_STARTED
from common.jsonlog import log_event
from common.settings import DEFAULT_USER_AGENT
from demo.cluster import Cluster
from demo.crawl import crawl
from demo.grants import GrantLog
from demo.outcomes import Outcomes
from demo.results import download_thumbnails, error_reasons, format_table, summarize, write_topics
from demo.sample import sample_web
from devstack.servers import free_port
from devstack.stack import LocalStack
from demo.simweb import SimWeb

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "out"
STACK_DIR = ROOT / ".devstack"
WORKERS = 2
CRAWL_TIMEOUT = 150.0  # seconds from scheduling; the sample needs well under half that
DASHBOARD_PORT = 8090
METRICS_WAIT = 30.0  # seconds for a worker to start and say where its /metrics is


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _port(preferred: int) -> int:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            return free_port()


def _fresh_out() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)


def _progress(outcomes: Outcomes, cluster: Cluster, bar: tqdm):
    def update(new: int) -> None:
        bar.update(new)
        bar.set_postfix(outcomes.totals(), refresh=False)
        for child in cluster.died():
            raise RuntimeError(f"{child.name} exited with {child.process.returncode}; see {child.log_path}")
    return update


def run() -> int:
    started = time.monotonic()
    _fresh_out()
    print("building the sample site (scikit-image photos, every format)...", flush=True)
    specs, plan = sample_web()
    web = SimWeb(specs, log_path=OUT / "requests.jsonl")
    print("starting Kafka, Redis and S3 from their wheels...", flush=True)
    with LocalStack(STACK_DIR) as addresses:
        dashboard = _port(DASHBOARD_PORT)
        base = {**os.environ, **addresses.environment(), "PYTHONPATH": str(ROOT)}
        # Each worker's /metrics on a free port of its own, which it logs (worker_metrics_started).
        with (GrantLog(addresses.redis_url, web.sites) as grants,
              crawl(web, plan, base, OUT, WORKERS, MONITOR_PORT=str(dashboard),
                    WORKER_METRICS_PORT="0") as (cluster, outcomes)):
            print(f"monitor and {WORKERS} workers running, crawl scheduled; "
                  f"dashboard http://127.0.0.1:{dashboard}/ ; logs in {OUT}/", flush=True)
            ports = [child.logged(EVENT_WORKER_METRICS_STARTED, METRICS_WAIT)["port"]
                     for child in cluster.children if child.name.startswith("worker")]
            print(f"Prometheus metrics: http://127.0.0.1:{dashboard}/metrics (monitor), "
                  + ", ".join(f"http://127.0.0.1:{port}/metrics" for port in ports) + " (workers)", flush=True)
            with tqdm(total=len(plan), unit="url", desc="outcomes") as bar:
                complete = outcomes.wait(CRAWL_TIMEOUT, _progress(outcomes, cluster, bar))
            print("stopping the crawler...", flush=True)
            codes = cluster.stop()
        rows = summarize(web, plan, outcomes, addresses.redis_url, grants)
        thumbnails = download_thumbnails(
            addresses, [u for u in outcomes.kinds if outcomes.kind_of(u) == "quality"], OUT / "thumbnails")
        topic_files = write_topics(outcomes, OUT)
    print("\n" + format_table(rows))
    print(f"\ncrawl errors by reason: {dict(error_reasons(outcomes))}")
    not_polite = [r.user_agent for s in web.sites.values() for r in s.log if r.user_agent != DEFAULT_USER_AGENT]
    print(f"requests without the crawler's User-Agent: {len(not_polite)}")
    print(f"\nresults in {OUT}/:")
    print(f"  {'thumbnails/':<30}{thumbnails} JPEGs from S3 (at most 640 px on the longer side)")
    for path in topic_files:
        print(f"  {path.name:<30}{sum(1 for _ in open(path))} messages")
    print(f"  {'requests.jsonl':<30}every request the sample site received (its own log)")
    print("  monitor.log, worker-N.log, tsv_producer.log, urls.tsv, sources.json")
    print(f"exit codes: {codes}; {time.monotonic() - started:.0f} s in all")
    if not complete:
        missing = outcomes.missing()
        print(f"\nINCOMPLETE: {len(missing)} URLs got no outcome within {CRAWL_TIMEOUT:.0f} s", file=sys.stderr)
        return 1
    return 0


def main() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a background job inherits it ignored
        signal.signal(signum, _interrupt)
    try:
        code = run()
    except KeyboardInterrupt:
        log_event(EVENT_DEMO_INTERRUPTED)
        code = 130
    except Exception as exc:  # noqa: BLE001 - any failure: the servers and children are already stopped
        print(f"demo failed: {exc}", file=sys.stderr)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
