"""Scheduler fairness: ``python -m bench.scheduler [--seconds S]``.

One source limited to 100 req/s and 100 sources at 0.5 req/s (150 req/s in
all), each on its own local site (a port of 127.0.0.1) answering a small
JPEG after 200 ms. The local stack, the monitor's rate-limit regulator
(token refills once a second) and one ``python -m worker`` run for real;
URLs go straight to the ``urls.{source}`` topics. The sites' own arrival
times are the evidence: the achieved total rate should be >= 95% of 150
req/s, and no site seeing more than floor(limit) + 1 requests of its source in any
sliding second.

All sites share the host 127.0.0.1, so the per-host connection cap is raised
(CRAWL_PER_HOST_CONNECTIONS) to what the fast source needs: the bench is
about scheduling, not the cap.
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
import uuid
from pathlib import Path

import redis.asyncio as aioredis
from confluent_kafka import Producer

from bench.site_process import serve_until_stopped
from bench.cpu import stat_cpu
from common.contracts import INBOUND_SOURCES, URLS_TOPIC, override_rate_key
from common.kafka import ensure_topics, produce_waiting, producer_config
from crawl_monitor.regulator import Regulator
from common.contracts import allowed_per_second
from demo.simweb import busiest_second
from devstack.servers import DEV_URL_PARTITIONS, free_port
from devstack.stack import LocalStack

ROOT = Path(__file__).resolve().parent.parent
FAST, SLOW = ("fast", 100.0), 0.5
SLOW_SOURCES = [f"slow{i:03d}" for i in range(100)]
LATENCY = 0.2
WARMUP = 20.0


def serve(ports_path: str, log_path: str) -> None:
    """The sites: one port per source, every image after LATENCY s; arrival times logged on SIGTERM.
    The times are the kernel's receive stamps: this loop, busy with 150 req/s on a loaded
    machine, would log requests it read late as a burst (demo.simweb)."""
    from aiohttp import web
    from PIL import Image

    from demo.simweb import arrival, stamped_listener

    out = io.BytesIO()
    Image.new("RGB", (64, 48), (90, 140, 200)).save(out, "JPEG", quality=85)
    body, arrivals = out.getvalue(), []

    async def image(request: web.Request) -> web.Response:
        arrivals.append((request.url.port, arrival(request)))
        await asyncio.sleep(LATENCY)
        return web.Response(body=body, content_type="image/jpeg")

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/img/{name}", image)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        ports = json.loads(Path(ports_path).read_text())
        for port in ports.values():
            await web.SockSite(runner, stamped_listener("127.0.0.1", port)).start()
        await serve_until_stopped(runner, log_path, arrivals)

    asyncio.run(main())


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU of one process (not its children), from /proc."""
    return stat_cpu(Path(f"/proc/{pid}/stat"))


def main_thread_cpu_seconds(pid: int) -> float:
    """User + system CPU of the process's main thread (the event loop), from /proc."""
    return stat_cpu(Path(f"/proc/{pid}/task/{pid}/stat"))


async def redis_calls(redis_url: str) -> dict[str, int]:
    """Commands served by Redis so far, by name (INFO commandstats): what a request costs in round trips."""
    redis = aioredis.from_url(redis_url, decode_responses=True)
    try:
        stats = await redis.info("commandstats")
    finally:
        await redis.aclose()
    return {name.removeprefix("cmdstat_"): int(values["calls"]) for name, values in stats.items()}


def load(kafka_hosts: str, ports: dict[str, int], seconds: float) -> int:
    producer = Producer(producer_config(kafka_hosts, **{"linger.ms": 50}))
    total = 0
    plan = {FAST[0]: int(FAST[1] * (seconds + WARMUP) * 1.3)} | {s: int(SLOW * (seconds + WARMUP) * 1.5) + 2
                                                                 for s in SLOW_SOURCES}
    for source, count in plan.items():
        for n in range(count):
            value = json.dumps({"url": f"http://127.0.0.1:{ports[source]}/img/{n}.jpg",
                                "uuid": str(uuid.uuid4()), "source": source}).encode()
            produce_waiting(producer, URLS_TOPIC, value, source)
            total += 1
    assert producer.flush(120) == 0
    return total


async def tick_each_second(regulator: Regulator, stop: asyncio.Event) -> None:
    """Tick on the second until ``stop``, as ``python -m crawl_monitor`` does."""
    while not stop.is_set():
        await regulator.tick(time.time())
        try:
            await asyncio.wait_for(stop.wait(), 1.0 - time.time() % 1.0)
        except TimeoutError:
            pass


async def regulate(redis_url: str, stop: asyncio.Event) -> None:
    """The monitor's regulator, ticking once a second as ``python -m crawl_monitor`` would."""
    redis = aioredis.from_url(redis_url, decode_responses=True)
    try:
        await tick_each_second(Regulator(redis), stop)
    finally:
        await redis.aclose()


async def run(args: argparse.Namespace) -> None:
    sources = {FAST[0]: FAST[1]} | {s: SLOW for s in SLOW_SOURCES}
    ports: dict[str, int] = {}
    while len(set(ports.values())) < len(sources):  # free_port may hand out a port twice
        ports = {source: free_port() for source in sources}
    folder = Path(tempfile.mkdtemp(prefix="bench-scheduler-"))
    (folder / "ports.json").write_text(json.dumps(ports))
    log_path = str(folder / "arrivals.json")
    with LocalStack(folder / "stack") as stack:
        site = subprocess.Popen([sys.executable, "-c", f"from bench.scheduler import serve; "
                                 f"serve({str(folder / 'ports.json')!r}, {log_path!r})"], cwd=ROOT)
        while not Path(log_path + ".ready").exists():
            if site.poll() is not None:
                raise SystemExit("the sites did not start (a port was taken?): run again")
            time.sleep(0.1)
        redis = aioredis.from_url(stack.redis_url, decode_responses=True)
        await redis.sadd(INBOUND_SOURCES, *sources)
        for source, rate in sources.items():
            await redis.set(override_rate_key(source), rate)
        await redis.aclose()
        ensure_topics(stack.kafka_hosts, [URLS_TOPIC], DEV_URL_PARTITIONS)
        messages = load(stack.kafka_hosts, ports, args.seconds)
        stop = asyncio.Event()
        regulator = asyncio.create_task(regulate(stack.redis_url, stop))
        env = {**os.environ, **stack.environment(), "PYTHONPATH": str(ROOT),
               "CRAWL_ALLOW_PRIVATE_NETWORKS": "true", "CRAWL_PER_HOST_CONNECTIONS": "64"}
        worker_log = open(folder / "worker.log", "wb")
        profile = ["-m", "cProfile", "-o", args.profile] if args.profile else []
        worker = subprocess.Popen([sys.executable, *profile, "-m", "worker"], cwd=ROOT, env=env,
                                  stdout=worker_log, stderr=subprocess.STDOUT)
        started = time.time()
        try:
            await asyncio.sleep(WARMUP)
            cpu_before, main_before = process_cpu_seconds(worker.pid), main_thread_cpu_seconds(worker.pid)
            calls_before = await redis_calls(stack.redis_url)
            await asyncio.sleep(args.seconds)
            worker_cpu = process_cpu_seconds(worker.pid) - cpu_before
            main_cpu = main_thread_cpu_seconds(worker.pid) - main_before
            calls_after = await redis_calls(stack.redis_url)
        finally:
            worker.send_signal(signal.SIGTERM)
            await asyncio.to_thread(worker.wait, 60)
            stop.set()
            await regulator
            site.send_signal(signal.SIGTERM)
            site.wait(30)
    arrivals = json.loads(Path(log_path).read_text())
    report(arrivals, ports, sources, started + WARMUP, args.seconds, messages, worker.returncode, folder)
    requests = sum(started + WARMUP <= at < started + WARMUP + args.seconds for _port, at in arrivals)
    print(f"worker main process: {worker_cpu / args.seconds:.0%} of a core, "
          f"{worker_cpu * 1000 / max(requests, 1):.2f} ms CPU per request (image pool not counted); "
          f"its event-loop thread {main_cpu * 1000 / max(requests, 1):.2f} ms")
    # Everyone's commands (the regulator's too, which do not scale with requests); the worker's dominate.
    calls = {name: n - calls_before.get(name, 0) for name, n in calls_after.items()}
    calls = {name: n for name, n in sorted(calls.items(), key=lambda item: -item[1]) if n}
    print(f"redis commands per request: {sum(calls.values()) / max(requests, 1):.1f} ("
          + ", ".join(f"{name} {n / max(requests, 1):.2f}" for name, n in list(calls.items())[:8]) + ")")


def report(arrivals, ports, sources, window_start: float, seconds: float, messages: int, code: int,
           folder: Path) -> None:
    by_port = {port: source for source, port in ports.items()}
    counts = {source: 0 for source in sources}
    times: dict[str, list[float]] = {source: [] for source in sources}
    for port, at in arrivals:
        times[by_port[port]].append(at)
        if window_start <= at < window_start + seconds:
            counts[by_port[port]] += 1
    rates = {source: count / seconds for source, count in counts.items()}
    slow = [rates[s] for s in SLOW_SOURCES]
    total, limit = sum(rates.values()), sum(sources.values())
    over = [s for s, r in rates.items() if counts[s] > sources[s] * seconds + max(1.0, sources[s])]
    print(f"\n{messages} URLs queued; window {seconds:.0f} s "
          f"after {WARMUP:.0f} s warm-up; worker exit code {code}; load average {os.getloadavg()[0]:.2f}; "
          f"logs in {folder}")
    print(f"{'sources':<22}{'limit req/s':>12}{'achieved req/s':>16}{'share':>8}")
    print(f"{'fast (1)':<22}{FAST[1]:>12.1f}{rates[FAST[0]]:>16.1f}{rates[FAST[0]] / FAST[1]:>8.0%}")
    print(f"{'slow (100), sum':<22}{SLOW * 100:>12.1f}{sum(slow):>16.1f}{sum(slow) / (SLOW * 100):>8.0%}")
    print(f"{'slow, min / max each':<22}{SLOW:>12.2f}{min(slow):>8.2f} / {max(slow):.2f}")
    print(f"{'total':<22}{limit:>12.1f}{total:>16.1f}{total / limit:>8.0%}")
    print(f"sources over their limit in the window: {over or 'none'}")
    peaks = {source: busiest_second(sorted(ts))[0] for source, ts in times.items()}
    print(f"busiest sliding second, whole run: fast {peaks[FAST[0]]} (allowed {allowed_per_second(FAST[1])}), "
          f"slow at most {max(peaks[s] for s in SLOW_SOURCES)} (allowed {allowed_per_second(SLOW)}); "
          f"sources above floor(limit) + 1: "
          f"{[s for s in sources if peaks[s] > allowed_per_second(sources[s])] or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window after the warm-up")
    parser.add_argument("--profile", help="write the worker's cProfile statistics to this file")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
