"""Thousands of sources through the whole crawler: ``python -m bench.sources --sources N [N ...]``.

The issue-20 set-up: one source limited to 100 req/s with 9,000 URLs plus N
slow sources at 0.5 req/s with 4 URLs each (fewer past 5,000 sources: 20,000
in all, at least one each, so 100,000 sources get one), all on one local site
(one port, the source in the path: one origin, so one robots.txt, however many
sources) answering a small JPEG after 200 ms. Every rate is an
``override_rate`` key, set in one pipeline. A real monitor (splitter,
regulator, breaker) and two ``python -m worker`` run on the local stack; the
URLs go to ``inbound_images`` as a pipeline would send them. Several sizes run
one after the other, each on a fresh stack, and are compared at the end.
Printed, from the site's own arrival log, the processes' /proc and logs, and
the broker:

- distinct URLs requested, and requests repeated (an eager rebalance re-reads what
  was in flight, so Redis's outcome counters alone could hide a URL never requested);
- time to the first request and until every source had one, counted from the
  moment the last URL was acknowledged by the broker;
- URLs with an outcome (Redis ``num_resized`` + ``resize_errors``), and when every
  URL had been requested (the site counts distinct URLs) and counted;
- the fast source's share of its limit over a 60 s window (10 s after its
  first request), and the share of the summed limits over the run;
- CPU and peak RSS per process tree (the monitor, each worker with its image
  pool, the site, tansu, valkey, weed; sampled every second) and the most
  Redis connections each crawler process held at once;
- requests a second over time, fast and slow, and new sources reached;
- how long the monitor took to stop;
- ``worker_partitions`` events after each worker's first (rebalances), and how
  many came after the URLs were produced;
- the broker's topics and partitions, and the messages in each internal topic
  per distinct URL crawled, the fast source's apart from the slow ones';
- the largest ``monitoring_update`` line in the monitor's log.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import redis
from confluent_kafka import Producer

from bench.broker import read_all, topic_partitions
from bench.cpu import TreeSampler, _tree
from bench.logs import read_log
from bench.site_process import serve_until_stopped
from common.contracts import (EVENT_INFRA_RETRY, EVENT_KAFKA_CLIENT_ERROR, EVENT_MONITOR_COMPONENT_ERROR,
                              EVENT_WORKER_PARTITIONS, EVENT_WORKER_REFRESH_FAILED, EVENT_WORKER_SLOW_SOURCES_HELD,
                              EVENT_WORKER_SUBSCRIBED, EVENT_WORKER_TOKENS_FORFEITED)
from common.contracts import (EVENT_MONITORING_UPDATE, HALTED_URLS_TOPIC, INBOUND_TOPIC, NUM_RESIZED, RESIZE_ERRORS,
                              URLS_TOPIC, WAIT_TOPICS, override_rate_key)
from common.kafka import produce_waiting, producer_config
from demo.cluster import Cluster
from demo.crawl import crawler_env
from devstack.stack import LocalStack

ROOT = Path(__file__).resolve().parent.parent
FAST, FAST_RATE, FAST_URLS = "fast", 100.0, 9_000
SLOW, SLOW_RATE, SLOW_URLS, SLOW_URLS_CAP = "slow", 0.5, 4, 20_000
INTERNAL_TOPICS = (INBOUND_TOPIC, URLS_TOPIC, *WAIT_TOPICS, HALTED_URLS_TOPIC)
DEADLINE, DEADLINE_PACE = 300.0, 100.0  # s after the URLs are produced; URLs a second, for bigger runs
LATENCY = 0.2
SHARE_WINDOW = (10.0, 70.0)  # seconds after the fast source's first request
RAMP_WINDOW = (10.0, 50.0)  # the 40 s after its ramp (its slow start), from its first request
PRODUCED_WINDOW = (20.0, 60.0)  # from 20 s after the URLs were produced
EVENTS_COUNTED = {EVENT_INFRA_RETRY, EVENT_WORKER_REFRESH_FAILED, EVENT_WORKER_SUBSCRIBED, EVENT_WORKER_PARTITIONS,
                  EVENT_MONITOR_COMPONENT_ERROR, EVENT_KAFKA_CLIENT_ERROR, EVENT_WORKER_TOKENS_FORFEITED,
                  EVENT_WORKER_SLOW_SOURCES_HELD}


def serve(log_path: str) -> None:
    """The site: ``/img/{source}/{n}.jpg`` answered after LATENCY s; (source, time) logged on SIGTERM.
    It binds a port of the kernel's choice and writes it to ``{log_path}.port`` before it says it
    is ready: a port picked free beforehand can be taken by the stack's servers in between."""
    from aiohttp import web
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (64, 48), (90, 140, 200)).save(out, "JPEG", quality=85)
    body, arrivals, distinct = out.getvalue(), [], set()

    async def image(request: web.Request) -> web.Response:
        arrivals.append((request.match_info["source"], time.time(), request.match_info["name"]))
        distinct.add((request.match_info["source"], request.match_info["name"]))
        await asyncio.sleep(LATENCY)
        return web.Response(body=body, content_type="image/jpeg")

    async def distinct_count(request: web.Request) -> web.Response:
        return web.Response(text=str(len(distinct)))

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/img/{source}/{name}", image)
        app.router.add_get("/distinct", distinct_count)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, backlog=4096).start()
        Path(log_path + ".port").write_text(str(runner.addresses[0][1]))
        await serve_until_stopped(runner, log_path, arrivals)

    asyncio.run(main())


def connections_to(port: int, pids: dict[str, int]) -> dict[str, int]:
    """Established TCP connections to ``port`` held by each named process tree (/proc, no psutil)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                inodes.add(fields[9])
    counts = {}
    for name, pid in pids.items():
        n = 0
        for member in _tree(pid):
            try:
                for fd in os.scandir(f"/proc/{member}/fd"):
                    link = os.readlink(fd.path)
                    if link.startswith("socket:[") and link[8:-1] in inodes:
                        n += 1
            except OSError:
                continue
        counts[name] = n
    return counts


def print_timeline(arrivals: list, produced: float, step: float = 10.0) -> None:
    """Requests a second per ``step`` s since the URLs were produced: where the stalls and ramps are."""
    fast, slow, new, seen = {}, {}, {}, set()
    for source, at, _name in sorted(arrivals, key=lambda arrival: arrival[1]):
        slot = int((at - produced) // step)
        counts = fast if source == FAST else slow
        counts[slot] = counts.get(slot, 0) + 1
        if source not in seen:
            seen.add(source)
            new[slot] = new.get(slot, 0) + 1
    print(f"per second, {step:.0f} s at a time: fast source / slow sources / sources with their first request")
    for slot in range(max(fast.keys() | slow.keys()) + 1):
        print(f"  {slot * step:5.0f} s  {fast.get(slot, 0) / step:6.1f}  {slow.get(slot, 0) / step:6.1f}"
              f"  {new.get(slot, 0) / step:6.1f}")


def produce(kafka_hosts: str, port: int, plan: dict[str, int]) -> int:
    """Every URL to inbound_images, sources interleaved (a source's n-th URL after every source's
    n-1-th). The messages are formatted, not dumped, and a round skips the sources already done:
    at 100,000 sources the loader must stay a small part of the run."""
    producer = Producer(producer_config(kafka_hosts, **{"linger.ms": 50}))
    run_id = uuid.uuid4().hex[:12]
    left = sorted(plan.items(), key=lambda item: -item[1])  # the sources done first at the end
    total = 0
    for n in range(left[0][1] if left else 0):
        while left[-1][1] <= n:
            left.pop()
        for source, _count in left:  # source names are [a-z0-9]: nothing to escape
            value = (f'{{"url": "http://127.0.0.1:{port}/img/{source}/{n}.jpg", '
                     f'"uuid": "{run_id}-{total}", "source": "{source}"}}').encode()
            produce_waiting(producer, INBOUND_TOPIC, value)
            total += 1
    assert producer.flush(120) == 0
    return total


def set_rates(client: redis.Redis, rates: dict[str, float], chunk: int = 10_000) -> None:
    """Every source's ``override_rate`` (0.5 req/s is below the computed rates' floor), one MSET
    per ``chunk`` keys in one pipeline: 100,000 sources in one round trip, Redis never blocked long."""
    items = list(rates.items())
    with client.pipeline(transaction=False) as pipe:
        for start in range(0, len(items), chunk):
            pipe.mset({override_rate_key(source): rate for source, rate in items[start:start + chunk]})
        pipe.execute()


def slow_urls_each(sources: int, asked: int | None) -> int:
    """4 URLs a slow source, fewer past 5,000 sources (SLOW_URLS_CAP in all), at least one."""
    return asked if asked is not None else max(1, min(SLOW_URLS, SLOW_URLS_CAP // max(sources, 1)))


def tally_messages(hosts: str, partitions: dict[str, int]) -> dict[tuple[str, str], int]:
    """Messages each topic holds, the fast source's (FAST) apart from the slow ones' (SLOW): which
    URLs were parked, and how often. Read whole, since tansu misreports high watermarks."""
    held: dict[tuple[str, str], int] = {}

    def tally(topic: str, value: bytes) -> None:
        try:
            source = json.loads(value).get("source")
        except (ValueError, AttributeError):
            source = None
        key = (topic, FAST if source == FAST else SLOW)
        held[key] = held.get(key, 0) + 1
    read_all(hosts, partitions, tally)
    return held


def server_pids(stack: LocalStack) -> dict[str, int]:
    """The stack's servers by program ("kafka (tansu)" -> "tansu")."""
    return {server.name.split("(")[-1].rstrip(")"): server.process.pid
            for server in stack.servers if server.process is not None}


def mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def run(args: argparse.Namespace, sources: int) -> dict[str, float]:
    """One crawl of ``sources`` slow sources plus the fast one on a fresh stack; prints what it
    measured and returns the figures compared across sizes."""
    slow = [f"{SLOW}{i:06d}" for i in range(sources)]
    urls_each = slow_urls_each(sources, args.urls_per_source)
    rates = {FAST: FAST_RATE} | {s: SLOW_RATE for s in slow}
    plan = {FAST: FAST_URLS} | {s: urls_each for s in slow}
    total_planned = sum(plan.values())
    deadline_seconds = args.deadline or max(DEADLINE, total_planned / DEADLINE_PACE)
    folder = Path(tempfile.mkdtemp(prefix=f"bench-sources-{sources}-"))
    log_path = str(folder / "arrivals.json")
    print(f"\n=== {sources} slow sources x {urls_each} URLs + 1 fast x {FAST_URLS}; logs in {folder}", flush=True)
    # Every rate is an override; the list names one source only so that it loads.
    (folder / "sources.json").write_text(json.dumps([{"source_name": FAST, "image_count": 5_000}]))
    local = LocalStack(folder / "stack")
    with local as stack:
        redis_port = int(stack.redis_url.rsplit(":", 1)[1].split("/")[0])
        site = subprocess.Popen([sys.executable, "-c", f"from bench.sources import serve; serve({log_path!r})"],
                                cwd=ROOT)
        while not Path(log_path + ".ready").exists():
            if site.poll() is not None:
                raise SystemExit("the site did not start")
            time.sleep(0.1)
        port = int(Path(log_path + ".port").read_text())
        client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        rates_started = time.monotonic()
        set_rates(client, rates)
        print(f"rates of {len(rates)} sources set in {time.monotonic() - rates_started:.1f} s", flush=True)
        partitions_setting = {"URL_PARTITIONS": str(args.partitions)} if args.partitions else {}
        env = {**crawler_env(stack.environment(), folder / "sources.json", CRAWL_PER_HOST_CONNECTIONS="1000",
                             MAX_TASKS=str(args.max_tasks), **partitions_setting),
               "PYTHONPATH": str(ROOT)}
        cluster = Cluster(env, folder)
        cluster.start(args.workers)
        sampler = TreeSampler({c.name: c.pid for c in cluster.children} | {"site": site.pid}
                              | server_pids(local)).start()
        time.sleep(args.settle)  # the processes up, the workers in their group
        sampler.mark_cpu()
        started, producer_cpu = time.time(), time.process_time()
        total = produce(stack.kafka_hosts, port, plan)
        produced = time.time()
        print(f"{total} URLs produced in {produced - started:.1f} s ({time.process_time() - producer_cpu:.2f} s "
              f"CPU of the producer); load {os.getloadavg()}", flush=True)
        most: dict[str, int] = {}
        done_at, outcomes, deadline = None, 0, produced + deadline_seconds
        while time.time() < deadline:
            time.sleep(1.0)
            outcomes = sum(int(v or 0) for v in client.mget([NUM_RESIZED, RESIZE_ERRORS]))
            held = connections_to(redis_port, {c.name: c.pid for c in cluster.children})
            most = {name: max(n, most.get(name, 0)) for name, n in held.items()}
            if cluster.died():
                print(f"died: {[c.name for c in cluster.died()]}")
                break
            # Done when every URL was requested (the counters alone count a re-read URL twice).
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/distinct", timeout=10) as answer:
                requested = int(answer.read())
            if outcomes >= total and requested >= total:
                done_at = time.time()
                break
        sampler.sample()
        cpu = sampler.cpu()
        elapsed = time.time() - started
        stop_started = time.time()
        codes = Cluster.stop_children([c for c in cluster.children if c.name == "monitor"], grace=60)
        monitor_stop = time.time() - stop_started
        codes |= cluster.stop()
        sampler.stop()
        site.send_signal(signal.SIGTERM)
        site.wait(60)
        # Read once nothing writes any more.
        partitions = topic_partitions(stack.kafka_hosts)
        internal = {topic: partitions[topic] for topic in INTERNAL_TOPICS if topic in partitions}
        held = tally_messages(stack.kafka_hosts, internal)
    arrivals = json.loads(Path(log_path).read_text())
    first: dict[str, float] = {}
    fast_times = []
    for source, at, _name in arrivals:
        first.setdefault(source, at)
        if source == FAST:
            fast_times.append(at)
    distinct_urls = {(source, name) for source, _at, name in arrivals}
    distinct = len(distinct_urls)
    figures: dict[str, float] = {"sources": sources, "urls": total}
    print(f"\n{sources} slow sources x {urls_each} + 1 fast, {args.workers} workers, {partitions.get(URLS_TOPIC)} "
          f"partitions of {URLS_TOPIC}; logs in {folder}")
    print(f"load average at the end: {os.getloadavg()}")
    if first:
        figures["first_request"] = min(first.values()) - produced
        print(f"first request: {figures['first_request']:.1f} s after the URLs were produced")
    print(f"sources with a request: {len(first)} of {len(plan)}"
          + (f"; all by {max(first.values()) - produced:.1f} s" if len(first) == len(plan) else ""))
    if len(first) == len(plan):
        figures["every_source"] = max(first.values()) - produced
    print(f"URLs with an outcome (counters, repeats included): {outcomes} of {total}"
          + (f"; every URL requested and counted at {done_at - produced:.1f} s" if done_at
             else f" at the {deadline_seconds:.0f} s deadline"))
    if done_at:
        figures["every_url"] = done_at - produced
    if fast_times:
        start = fast_times[0] + SHARE_WINDOW[0]
        window = SHARE_WINDOW[1] - SHARE_WINDOW[0]
        in_window = sum(start <= t < start + window for t in fast_times)
        figures["fast_share"] = in_window / window / FAST_RATE
        print(f"fast source: {in_window / window:.1f} req/s in [{SHARE_WINDOW[0]:.0f}, {SHARE_WINDOW[1]:.0f}) s "
              f"after its first request = {figures['fast_share']:.0%} of its limit")
        for key, (since, begin, end), label in (
                ("fast_share_ramp", (fast_times[0], *RAMP_WINDOW), "its first request"),
                ("fast_share_produced", (produced, *PRODUCED_WINDOW), "the URLs were produced")):
            count = sum(since + begin <= t < since + end for t in fast_times)
            figures[key] = count / (end - begin) / FAST_RATE
            print(f"fast source: {count / (end - begin):.1f} req/s in [{begin:.0f}, {end:.0f}) s after {label} "
                  f"= {figures[key]:.0%} of its limit")
        slow_last = max((at for source, at, _name in arrivals if source != FAST), default=produced)
        print(f"the slow sources' last request at {slow_last - produced:.1f} s after the URLs were produced")
    if arrivals:
        print_timeline(arrivals, produced)
        span = max(at for _s, at, _n in arrivals) - min(at for _s, at, _n in arrivals)
        print(f"all requests: {len(arrivals)} over {span:.1f} s = {len(arrivals) / max(span, 1e-9):.0f} req/s "
              f"(summed limits {sum(rates.values()):.0f} req/s)")
        print(f"distinct URLs requested: {distinct} of {total}; requested twice or more: {len(arrivals) - distinct}")
    print("CPU, s (share of a core over the run; a worker with its image pool):  " + ", ".join(
        f"{name} {seconds:.1f} ({seconds / elapsed:.0%})" for name, seconds in cpu.items()))
    print("peak RSS, MiB (sampled every second; a worker with its image pool):  " + ", ".join(
        f"{name} {mib(rss)}" for name, rss in sampler.peak_rss.items()))
    figures["worker_rss"] = max((rss for name, rss in sampler.peak_rss.items() if name.startswith("worker")),
                                default=0)
    print("most Redis connections held at once:  " + ", ".join(f"{n} {c}" for n, c in most.items()))
    print(f"monitor stopped in {monitor_stop:.1f} s; exit codes {codes}")
    figures["broker_partitions"] = sum(partitions.values())
    print(f"broker: {len(partitions)} topics, {figures['broker_partitions']} partitions "
          f"({sum(internal.values())} of them in {len(internal)} internal topics)")
    crawled = {FAST: sum(source == FAST for source, _name in distinct_urls)}
    crawled[SLOW] = len(distinct_urls) - crawled[FAST]
    figures["messages_per_url"] = sum(held.values()) / max(len(distinct_urls), 1)
    print(f"messages in the internal topics (each written once, read at least once) per URL crawled "
          f"({len(distinct_urls)} distinct URLs requested): {figures['messages_per_url']:.2f} "
          f"(per URL produced: {sum(held.values()) / max(total, 1):.2f})")
    for kind, label in ((FAST, "the fast source"), (SLOW, "the slow sources")):
        print(f"  {label} ({crawled[kind]} crawled): " + ", ".join(
            f"{topic} {held.get((topic, kind), 0) / max(crawled[kind], 1):.2f} ({held.get((topic, kind), 0)})"
            for topic in internal))
    facts = {log.stem: read_log(log, EVENTS_COUNTED, {EVENT_WORKER_PARTITIONS}, {EVENT_MONITORING_UPDATE})
             for log in sorted(folder.glob("*.log"))}
    for name, fact in facts.items():
        if fact.counts:
            print(f"{name}.log: {fact.counts}")
    rebalances = {name: fact.times.get(EVENT_WORKER_PARTITIONS, [])[1:]
                  for name, fact in facts.items() if name.startswith("worker")}
    figures["rebalances"] = sum(len(times) for times in rebalances.values())
    print("worker_partitions events after each worker's first assignment:  " + ", ".join(
        f"{name} {len(times)} ({sum(t > produced for t in times)} after the URLs were produced)"
        for name, times in rebalances.items()))
    longest = facts["monitor"].longest.get(EVENT_MONITORING_UPDATE, 0) if "monitor" in facts else 0
    figures["monitoring_update_bytes"] = longest
    print(f"largest monitoring_update line: {longest / 1024:.1f} KiB")
    print("issue 26's targets: " + "; ".join(f"{name} {'met' if met else 'NOT met'}" for name, met in targets(figures)))
    return figures


def targets(figures: dict[str, float]) -> list[tuple[str, bool]]:
    """Issue 26's "done when" for one run (the RSS against 5,000 sources is in ``compare``)."""
    return [("every URL's outcome", "every_url" in figures),
            ("first request <= 15 s", figures.get("first_request", float("inf")) <= 15),
            ("every source <= 60 s", figures.get("every_source", float("inf")) <= 60),
            ("fast source >= 90%", figures.get("fast_share", 0.0) >= 0.9),
            ("fast source >= 90% in the 40 s after its ramp", figures.get("fast_share_ramp", 0.0) >= 0.9),
            ("fast source >= 90% from 20 s after the URLs were produced",
             figures.get("fast_share_produced", 0.0) >= 0.9),
            ("no rebalance after the first assignment", figures["rebalances"] == 0),
            ("monitoring_update <= 256 KiB", figures["monitoring_update_bytes"] <= 256 * 1024)]


def compare(runs: list[dict[str, float]]) -> None:
    """The sizes side by side; the worker's RSS against the first size's (issue 26: <= 1.25x at
    100,000 sources against 5,000)."""
    base = runs[0]
    print(f"\n{'sources':>8} {'URLs':>7} {'first req':>9} {'all srcs':>8} {'all URLs':>8} {'fast':>5} "
          f"{'rebal':>5} {'partitions':>10} {'msgs/URL':>8} {'worker RSS':>10} {'x first':>7} {'max update':>10}")
    for figures in runs:
        def show(key: str, form: str, figures: dict[str, float] = figures) -> str:
            return format(figures[key], form) + ("s" if form.endswith("f") else "") if key in figures else "-"
        ratio = figures["worker_rss"] / base["worker_rss"] if base["worker_rss"] else float("nan")
        print(f"{figures['sources']:>8.0f} {figures['urls']:>7.0f} {show('first_request', '.1f'):>9} "
              f"{show('every_source', '.1f'):>8} {show('every_url', '.1f'):>8} {show('fast_share', '.0%'):>5} "
              f"{figures['rebalances']:>5.0f} {figures['broker_partitions']:>10.0f} "
              f"{figures['messages_per_url']:>8.2f} {mib(int(figures['worker_rss'])):>6} MiB {ratio:>6.2f}x "
              f"{figures['monitoring_update_bytes'] / 1024:>6.0f} KiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", type=int, nargs="+", default=[1000],
                        help="slow sources (0.5 req/s each); several sizes run one after the other, each on a "
                             "fresh stack, and are compared at the end")
    parser.add_argument("--urls-per-source", type=int,
                        help=f"URLs of each slow source (default {SLOW_URLS}, fewer past "
                             f"{SLOW_URLS_CAP // SLOW_URLS:,} sources: {SLOW_URLS_CAP:,} in all, at least 1 each)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--partitions", type=int, help="URL_PARTITIONS: of the urls topic (default: the local stack's)")
    parser.add_argument("--max-tasks", type=int, default=500,
                        help="MAX_TASKS of each worker (the default setting: 500)")
    parser.add_argument("--deadline", type=float,
                        help=f"seconds after the URLs are produced (default {DEADLINE:.0f}, "
                             f"or 1 s per {DEADLINE_PACE:.0f} URLs if more)")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds between starting and producing")
    args = parser.parse_args()
    runs = [run(args, sources) for sources in args.sources]
    if len(runs) > 1:
        compare(runs)


if __name__ == "__main__":
    main()
