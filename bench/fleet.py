"""What the central services cost per URL: ``python -m bench.fleet [--workers N] [--rates R ...]``.

The real monitor (splitter, regulator, breaker, back-off), Redis and the broker of a
local stack, driven by simulated workers: each is the worker's own scheduler (parking
included), wait line and halted line, token buckets, stats script and outcome message,
with the network and the image work replaced by an instant answer (a token taken, then
a 200 recorded and a quality message sent, as ``worker.outcomes.task`` does after a download).
URLs go to ``inbound_images`` at rising rates (``--rates``, each for ``--seconds``),
each from a different one of ``--sources`` sources (100,000: every one active) whose
``override_rate`` lets it through. For each stage, from the differences over it:

- URLs ended (``num_resized``) a second;
- Redis: commands per URL and CPU per URL (``INFO``), and the URLs a second at which
  Redis would fill one core;
- the broker (tansu): messages per URL in all topics (the sum of the partitions' ends:
  tansu reports a partition's last batch's first offset + 1, an undercount of at most a
  batch a partition), CPU per URL, and the URLs a second at which it would fill a core;
- the monitor: CPU per URL and the URLs a second at which it would fill a core;
- the simulated workers' CPU per URL (the worker's non-image work; not central).

Then the projection: the first central process to fill a core and at what rate, the
fleet of boxes (``--box-rate`` URLs a second each, ~300 on this kind of machine) that
rate feeds, and the days 500 million images take at it. On a shared 2-core machine the
simulated workers, the monitor, Redis and the broker compete for the same cores: the
rate reached here is that of this machine, the costs per URL are what scale.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import redis
from confluent_kafka import Consumer, Producer, TopicPartition

from bench.broker import topic_partitions
from bench.cpu import tree_cpu
from bench.sources import server_pids, set_rates
from common.contracts import INBOUND_TOPIC, NUM_RESIZED, METADATA_TOPIC, quality_message
from common.kafka import consumer_config, produce_waiting, producer_config
from demo.cluster import Cluster
from demo.crawl import crawler_env
from devstack.stack import LocalStack

ROOT = Path(__file__).resolve().parent.parent
IMAGES = 500_000_000
SOURCE_RATE = 5.0  # each source's override_rate: never what holds a URL back here


def simulated_worker() -> None:
    """One simulated worker (run in a process of its own): the worker's scheduling, parking,
    tokens, stats and outcome paths; the request and the image work answer at once."""
    from common.contracts import HALTED_GROUP, WAIT_GROUP, WORKER_GROUP, CrawlRequest
    from common.kafka import AsyncConsumer, AsyncProducer
    from common.redis_client import bounded_redis
    from common.settings import Settings
    from worker.constants import CONSUMER_EXTRA_CONFIG, REDIS_MAX_CONNECTIONS
    from worker.intake.feed import KafkaFeed
    from worker.parking.hand_back_on_resume import HaltedLine
    from worker.intake.group_join import ensure_worker_topics
    from worker.scheduling.scheduler import Scheduler
    from worker.outcomes.stats import Stats
    from worker.outcomes.task import deliver
    from worker.fetching.tokens import TokenBuckets
    from worker.monitor_view import MonitorView
    from worker.parking.hand_back_when_due import WaitLine

    settings = Settings.from_env()

    async def main() -> None:
        ensure_worker_topics(settings)
        store = bounded_redis(settings.redis_url, REDIS_MAX_CONNECTIONS)
        producer = AsyncProducer(producer_config(settings.kafka_hosts))
        consumers = {group: AsyncConsumer(consumer_config(settings.kafka_hosts, group, **CONSUMER_EXTRA_CONFIG))
                     for group in (WORKER_GROUP, WAIT_GROUP, HALTED_GROUP)}
        view = MonitorView()
        tokens = TokenBuckets(store, view)
        stats = Stats(store)

        async def crawl(request: CrawlRequest) -> float:
            async with tokens.turn(request.source):
                while True:
                    await tokens.until_available(request.source)
                    if await tokens.take(request.source):
                        break
            await deliver(producer, METADATA_TOPIC, quality_message(request.uuid, 64, 48, 85, 1000),
                          request.source)
            await stats.record(request.source, "200", True, ttfb=0.01, terminal=True)
            return 0.01

        scheduler = Scheduler(KafkaFeed(consumers[WORKER_GROUP], WORKER_GROUP), store, crawl, producer, tokens,
                              view, settings.max_tasks, settings.shutdown_timeout, settings.max_queued_urls)
        lines = [WaitLine(KafkaFeed(consumers[WAIT_GROUP], WAIT_GROUP), producer, store, settings.url_partitions),
                 HaltedLine(KafkaFeed(consumers[HALTED_GROUP], HALTED_GROUP), producer, view,
                            settings.url_partitions)]
        loop = asyncio.get_running_loop()
        import signal
        loop.add_signal_handler(signal.SIGTERM, scheduler.stop)
        running = [asyncio.create_task(line.run()) for line in lines]
        try:
            await scheduler.run()
        finally:
            for line in lines:
                line.stop()
            await asyncio.wait(running, timeout=5)
            await producer.close(5)
            for consumer in consumers.values():
                await consumer.close(leave_group=False)
            await store.aclose()

    asyncio.run(main())


def produce_at(hosts: str, rate: float, seconds: float, sources: list[str], start: int, stop: threading.Event) -> int:
    """URLs to inbound_images at ``rate`` a second for ``seconds``, each of the next source in
    turn; returns how many."""
    producer = Producer(producer_config(hosts, **{"linger.ms": 20}))
    run_id = uuid.uuid4().hex[:8]
    began = time.monotonic()
    sent = 0
    while not stop.is_set():
        elapsed = time.monotonic() - began
        if elapsed >= seconds:
            break
        due = int(rate * elapsed)
        while sent < due:
            source = sources[(start + sent) % len(sources)]
            value = (f'{{"url": "http://127.0.0.1:9/img/{source}/{start + sent}.jpg", '
                     f'"uuid": "{run_id}-{sent}", "source": "{source}"}}').encode()
            produce_waiting(producer, INBOUND_TOPIC, value)
            sent += 1
        producer.poll(0)
        time.sleep(0.01)
    producer.flush(60)
    return sent


class Meter:
    """The counters a stage is measured by, read at its start and end."""

    def __init__(self, client: redis.Redis, hosts: str, pids: dict[str, list[int]]):
        self.client = client
        self.hosts = hosts
        self.pids = pids
        self.consumer = Consumer(consumer_config(hosts, f"bench-fleet-{uuid.uuid4().hex[:8]}"))

    def messages(self) -> int:
        total = 0
        for topic, count in topic_partitions(self.hosts).items():
            if topic.startswith("__"):
                continue
            for p in range(count):
                low, high = self.consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
                total += max(high - low, 0)
        return total

    def read(self) -> dict[str, float]:
        info = self.client.info()
        values = {"time": time.monotonic(), "ended": float(self.client.get(NUM_RESIZED) or 0),
                  "redis_commands": float(info["total_commands_processed"]),
                  "redis_cpu": float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
                  "messages": float(self.messages())}
        for name, pids in self.pids.items():
            values[f"cpu_{name}"] = sum(tree_cpu(pid) for pid in pids)
        return values


def per_core(cpu_us: float) -> float:
    return 1e6 / cpu_us if cpu_us > 0 else float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2, help="simulated workers (processes)")
    parser.add_argument("--rates", type=float, nargs="+", default=[100, 200, 400],
                        help="URLs a second produced, one stage each")
    parser.add_argument("--seconds", type=float, default=30.0, help="of each stage")
    parser.add_argument("--box-rate", type=float, default=300.0,
                        help="URLs a second one worker box crawls (for the fleet's size)")
    parser.add_argument("--max-tasks", type=int, default=500)
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    print(f"bench.fleet: {args.sources} sources, {args.workers} simulated workers, stages {args.rates} URLs/s "
          f"x {args.seconds:.0f} s; logs in {folder}; load {os.getloadavg()}", flush=True)
    sources = [f"s{i:06d}" for i in range(args.sources)]
    (folder / "sources.json").write_text(json.dumps([{"source_name": sources[0], "image_count": 5_000}]))
    local = LocalStack(folder / "stack")
    with local as stack:
        client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        set_rates(client, {s: SOURCE_RATE for s in sources})
        env = {**crawler_env(stack.environment(), folder / "sources.json", MAX_TASKS=str(args.max_tasks)),
               "PYTHONPATH": str(ROOT)}
        cluster = Cluster(env, folder)
        monitor = cluster.start_monitor()
        workers = []
        for n in range(args.workers):
            log = open(folder / f"simworker-{n + 1}.log", "w")  # noqa: SIM115 - closed with the process
            workers.append(subprocess.Popen(
                [sys.executable, "-c", "from bench.fleet import simulated_worker; simulated_worker()"],
                cwd=ROOT, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT))
        servers = server_pids(local)
        pids = {"monitor": [monitor.pid], "broker": [servers["tansu"]], "workers": [w.pid for w in workers]}
        meter = Meter(client, stack.kafka_hosts, pids)
        time.sleep(15)  # up, subscribed, in their groups
        rows = []
        produced = 0
        stop = threading.Event()
        try:
            for rate in args.rates:
                before = meter.read()
                sent = produce_at(stack.kafka_hosts, rate, args.seconds, sources, produced, stop)
                produced += sent
                after = meter.read()
                ended = after["ended"] - before["ended"]
                seconds = after["time"] - before["time"]
                row = {"rate": rate, "produced": sent / seconds, "ended": ended / seconds}
                per_url = max(ended, 1.0)
                row["redis_commands"] = (after["redis_commands"] - before["redis_commands"]) / per_url
                row["messages"] = (after["messages"] - before["messages"]) / per_url
                for name, key in (("redis", "redis_cpu"), ("broker", "cpu_broker"), ("monitor", "cpu_monitor"),
                                  ("workers", "cpu_workers")):
                    row[f"{name}_us"] = (after[key] - before[key]) * 1e6 / per_url
                    row[f"{name}_core"] = (after[key] - before[key]) / seconds
                row["raw"] = {k: after[k] - before[k] for k in after}  # type: ignore[assignment]
                rows.append(row)
                print(f"stage {rate:.0f} URLs/s: produced {row['produced']:.0f}/s, ended {row['ended']:.0f}/s; "
                      f"per URL: Redis {row['redis_commands']:.1f} commands {row['redis_us']:.0f} us "
                      f"({row['redis_core']:.0%} of a core), broker {row['messages']:.1f} messages "
                      f"{row['broker_us']:.0f} us ({row['broker_core']:.0%}), monitor {row['monitor_us']:.0f} us "
                      f"({row['monitor_core']:.0%}), simulated workers {row['workers_us']:.0f} us "
                      f"({row['workers_core']:.0%}); load {os.getloadavg()[0]:.1f}", flush=True)
        finally:
            stop.set()
            for worker in workers:
                worker.terminate()
            for worker in workers:
                try:
                    worker.wait(30)
                except subprocess.TimeoutExpired:
                    worker.kill()
            cluster.stop()
    for row in rows:
        print(f"stage {row['rate']:.0f}: differences over it {row['raw']}")
    report(rows, args)


def report(rows: list[dict[str, float]], args: argparse.Namespace) -> None:
    if not rows:
        return
    print(f"\n{'stage':>6} {'ended/s':>8} {'Redis cmd':>9} {'Redis us':>8} {'msgs':>5} {'broker us':>9} "
          f"{'monitor us':>10} {'workers us':>10}   URLs/s filling one core: Redis / broker / monitor")
    for r in rows:
        print(f"{r['rate']:>6.0f} {r['ended']:>8.0f} {r['redis_commands']:>9.1f} {r['redis_us']:>8.0f} "
              f"{r['messages']:>5.1f} {r['broker_us']:>9.0f} {r['monitor_us']:>10.0f} {r['workers_us']:>10.0f}   "
              f"{per_core(r['redis_us']):>7.0f} / {per_core(r['broker_us']):>7.0f} / {per_core(r['monitor_us']):>7.0f}")
    # The projection from the stage that ended the most URLs (the costs per URL there are the
    # least diluted by fixed per-second work).
    best = max(rows, key=lambda r: r["ended"])
    limits = {name: per_core(best[f"{name}_us"]) for name in ("redis", "broker", "monitor")}
    first = min(limits, key=lambda name: limits[name])
    rate = limits[first]
    print(f"\nprojection (from the {best['rate']:.0f} URLs/s stage, {best['ended']:.0f} ended a second here): "
          f"one core of {first} is filled at ~{rate:.0f} URLs/s (Redis {limits['redis']:.0f}, broker "
          f"{limits['broker']:.0f}, monitor {limits['monitor']:.0f}); at that rate a fleet of "
          f"{rate / args.box_rate:.0f} boxes of {args.box_rate:.0f} URLs/s crawls {IMAGES:,} images in "
          f"{IMAGES / rate / 86400:.1f} days")


if __name__ == "__main__":
    main()
