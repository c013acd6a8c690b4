"""Thousands of sources through the whole crawler: ``python -m bench.sources --sources N``.

The issue-20 set-up: one source limited to 100 req/s with 9,000 URLs plus N
slow sources at 0.5 req/s with 4 URLs each, all on one local site (one port,
the source in the path) answering a small JPEG after 200 ms. A real monitor
(splitter, regulator, breaker) and two ``python -m worker`` run on the local
stack; the URLs go to ``inbound_images`` as a pipeline would send them, so
the splitter creates every ``urls.{source}`` topic. Printed, from the site's
own arrival log and the processes' /proc:

- distinct URLs requested, and requests repeated (an eager rebalance re-reads what
  was in flight, so Redis's outcome counters alone could hide a URL never requested);
- time to the first request and until every source had one, counted from the
  moment the last URL was acknowledged by the broker;
- URLs with an outcome (Redis ``num_resized`` + ``resize_errors``), and when every
  URL had been requested (the site counts distinct URLs) and counted;
- the fast source's share of its limit over a 60 s window (10 s after its
  first request), and the share of the summed limits over the run;
- CPU per process (a worker with its image pool) and the most Redis
  connections each process held at once (sampled every second);
- requests a second over time, fast and slow, and new sources reached;
- how long the monitor took to stop.
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

from bench.site_process import serve_until_stopped
from bench.cpu import _tree, stat_cpu
from common.contracts import (EVENT_INFRA_RETRY, EVENT_KAFKA_CLIENT_ERROR, EVENT_MONITOR_COMPONENT_ERROR,
                              EVENT_WORKER_PARTITIONS, EVENT_WORKER_REFRESH_FAILED, EVENT_WORKER_SUBSCRIBED,
                              EVENT_WORKER_TOKENS_FORFEITED)
from common.contracts import INBOUND_TOPIC, NUM_RESIZED, RESIZE_ERRORS, override_rate_key
from common.kafka import produce_waiting, producer_config
from demo.cluster import Cluster
from demo.crawl import crawler_env
from devstack.servers import free_port
from devstack.stack import LocalStack

ROOT = Path(__file__).resolve().parent.parent
FAST, FAST_RATE, FAST_URLS = "fast", 100.0, 9_000
SLOW_RATE, SLOW_URLS = 0.5, 4
LATENCY = 0.2
SHARE_WINDOW = (10.0, 70.0)  # seconds after the fast source's first request
EVENTS_COUNTED = {EVENT_INFRA_RETRY, EVENT_WORKER_REFRESH_FAILED, EVENT_WORKER_SUBSCRIBED, EVENT_WORKER_PARTITIONS,
                  EVENT_MONITOR_COMPONENT_ERROR, EVENT_KAFKA_CLIENT_ERROR, EVENT_WORKER_TOKENS_FORFEITED}


def serve(port: int, log_path: str) -> None:
    """The site: ``/img/{source}/{n}.jpg`` answered after LATENCY s; (source, time) logged on SIGTERM."""
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
        await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
        await serve_until_stopped(runner, log_path, arrivals)

    asyncio.run(main())


def tree_cpu(pid: int) -> float:
    total = 0.0
    for member in _tree(pid):
        try:
            total += stat_cpu(Path(f"/proc/{member}/stat"))
        except OSError:
            continue
    return total


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
    """Every URL to inbound_images, sources interleaved (a source's n-th URL after every source's n-1-th)."""
    producer = Producer(producer_config(kafka_hosts, **{"linger.ms": 50}))
    total = 0
    for n in range(max(plan.values())):
        for source, count in plan.items():
            if n < count:
                value = json.dumps({"url": f"http://127.0.0.1:{port}/img/{source}/{n}.jpg",
                                    "uuid": str(uuid.uuid4()), "source": source}).encode()
                produce_waiting(producer, INBOUND_TOPIC, value)
                total += 1
    assert producer.flush(120) == 0
    return total


def run(args: argparse.Namespace) -> None:
    slow = [f"slow{i:05d}" for i in range(args.sources)]
    rates = {FAST: FAST_RATE} | {s: SLOW_RATE for s in slow}
    plan = {FAST: FAST_URLS} | {s: SLOW_URLS for s in slow}
    folder = Path(tempfile.mkdtemp(prefix="bench-sources-"))
    port, log_path = free_port(), str(folder / "arrivals.json")
    # Every rate is an override; the list names one source only so that it loads.
    (folder / "sources.json").write_text(json.dumps([{"source_name": FAST, "image_count": 5_000}]))
    with LocalStack(folder / "stack") as stack:
        redis_port = int(stack.redis_url.rsplit(":", 1)[1].split("/")[0])
        site = subprocess.Popen([sys.executable, "-c", f"from bench.sources import serve; serve({port}, {log_path!r})"],
                                cwd=ROOT)
        while not Path(log_path + ".ready").exists():
            if site.poll() is not None:
                raise SystemExit("the site did not start")
            time.sleep(0.1)
        client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        client.mset({override_rate_key(s): rate for s, rate in rates.items()})
        env = {**crawler_env(stack.environment(), folder / "sources.json", CRAWL_PER_HOST_CONNECTIONS="1000",
                            KAFKA_PARTITIONS=str(args.partitions), MAX_TASKS=str(args.max_tasks)),
               "PYTHONPATH": str(ROOT)}
        cluster = Cluster(env, folder)
        cluster.start(args.workers)
        time.sleep(args.settle)  # the processes up, the workers in their group
        cpu_start = {c.name: tree_cpu(c.pid) for c in cluster.children}
        started = time.time()
        total = produce(stack.kafka_hosts, port, plan)
        produced = time.time()
        print(f"{total} URLs produced in {produced - started:.1f} s; load {os.getloadavg()}", flush=True)
        most: dict[str, int] = {}
        done_at, outcomes, deadline = None, 0, produced + args.deadline
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
        cpu = {c.name: tree_cpu(c.pid) - cpu_start[c.name] for c in cluster.children}
        elapsed = time.time() - started
        stop_started = time.time()
        codes = Cluster.stop_children([c for c in cluster.children if c.name == "monitor"], grace=60)
        monitor_stop = time.time() - stop_started
        codes |= cluster.stop()
        site.send_signal(signal.SIGTERM)
        site.wait(60)
    arrivals = json.loads(Path(log_path).read_text())
    first: dict[str, float] = {}
    fast_times = []
    for source, at, _name in arrivals:
        first.setdefault(source, at)
        if source == FAST:
            fast_times.append(at)
    print(f"\n{args.sources} slow sources + 1 fast, {args.workers} workers, {args.partitions} partitions a topic; "
          f"logs in {folder}")
    print(f"load average at the end: {os.getloadavg()}")
    if first:
        print(f"first request: {min(first.values()) - produced:.1f} s after the URLs were produced")
    print(f"sources with a request: {len(first)} of {len(plan)}"
          + (f"; all by {max(first.values()) - produced:.1f} s" if len(first) == len(plan) else ""))
    print(f"URLs with an outcome (counters, repeats included): {outcomes} of {total}"
          + (f"; every URL requested and counted at {done_at - produced:.1f} s" if done_at
             else f" at the {args.deadline:.0f} s deadline"))
    if fast_times:
        start = fast_times[0] + SHARE_WINDOW[0]
        window = SHARE_WINDOW[1] - SHARE_WINDOW[0]
        in_window = sum(start <= t < start + window for t in fast_times)
        print(f"fast source: {in_window / window:.1f} req/s in [{SHARE_WINDOW[0]:.0f}, {SHARE_WINDOW[1]:.0f}) s "
              f"after its first request = {in_window / window / FAST_RATE:.0%} of its limit")
    if arrivals:
        print_timeline(arrivals, produced)
        span = max(at for _s, at, _n in arrivals) - min(at for _s, at, _n in arrivals)
        print(f"all requests: {len(arrivals)} over {span:.1f} s = {len(arrivals) / max(span, 1e-9):.0f} req/s "
              f"(summed limits {sum(rates.values()):.0f} req/s)")
        distinct = len({(source, name) for source, _at, name in arrivals})
        print(f"distinct URLs requested: {distinct} of {total}; requested twice or more: {len(arrivals) - distinct}")
    print("CPU, s (share of a core over the run):  " + ", ".join(
        f"{name} {seconds:.1f} ({seconds / elapsed:.0%})" for name, seconds in cpu.items()))
    print("most Redis connections held at once:  " + ", ".join(f"{n} {c}" for n, c in most.items()))
    print(f"monitor stopped in {monitor_stop:.1f} s; exit codes {codes}")
    for log in sorted(folder.glob("*.log")):
        events: dict[str, int] = {}
        for line in log.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line).get("event", "")
            except ValueError:
                continue
            if event in EVENTS_COUNTED:
                events[event] = events.get(event, 0) + 1
        if events:
            print(f"{log.name}: {events}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", type=int, default=1000, help="slow sources (0.5 req/s, 4 URLs each)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--partitions", type=int, default=4, help="KAFKA_PARTITIONS: of each urls.{source} topic")
    parser.add_argument("--max-tasks", type=int, default=500,
                        help="MAX_TASKS of each worker (the default setting: 500)")
    parser.add_argument("--deadline", type=float, default=300.0, help="seconds after the URLs are produced")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds between starting and producing")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
