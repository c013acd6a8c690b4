"""``python -m bench.soak``: a long crawl fed continuously; is every URL's outcome on the topics?

The real processes (a monitor, two workers) on the local stack crawl a simulated web
of several sources with some errors (404, 410, broken bodies, robots.txt rules, 500s,
429s), fed a fresh slice of unique URLs every few seconds for ``--minutes``. It prints
outcomes per URL produced (duplicates, which at-least-once allows, counted apart), and
every minute each process's RSS and open files and Redis's memory and keys, and at every
``--every`` URLs with an outcome how much each of them grew since the last such checkpoint
(does anything grow with the number of requests?).

A URL without an outcome is reconciled before anything is concluded: the outcome topics
are read again from the start by a fresh consumer (was it there, and the first reader
missed it?), its thumbnail is looked up in S3 (did the worker finish it?), and Redis's
``num_resized`` is set against the quality messages read (did a worker count a success
whose message is not on the topic?).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from pathlib import Path

import botocore.session
import redis
from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from bench.cpu import proc_rss_and_files
from common.contracts import NUM_RESIZED, URLS_TOPIC, WORKER_GROUP
from common.kafka import consumer_config
from demo.cluster import Cluster
from demo.crawl import crawler_env
from demo.outcomes import QUALITY, Outcomes
from devstack.servers import DEV_CREDENTIALS
from devstack.stack import LocalStack
from demo.simweb import Behaviour, SimWeb, standard_web, write_tsv

ROOT = Path(__file__).resolve().parent.parent
FEED_EVERY = 5.0     # seconds between two slices of new URLs
SAMPLE_EVERY = 60.0  # seconds between two resource samples
STALL = 120.0        # after the feed: give up once no new outcome came for this long


def behaviours(sources: int, rate: float) -> list[Behaviour]:
    """``sources`` sites sharing ``rate`` req/s, a few with errors, throttling or robots rules."""
    each = rate / sources
    return [Behaviour(rate=max(1.0, each * (0.5 + (i % 3) / 2)), urls=0, latency=0.01 * (i % 4),
                      error_rate=0.03 if i % 6 == 1 else 0.0, throttle_every=40 if i % 11 == 5 else 0,
                      robots_txt="User-agent: *\nDisallow: /private/\n" if i % 3 == 0 else None)
            for i in range(sources)]


def measure(cluster: Cluster, client: redis.Redis) -> dict[str, tuple[int, int]]:
    """Redis (used memory, keys) and every live process's (RSS, open files), by name."""
    figures = {"redis": (int(client.info("memory")["used_memory"]), int(client.dbsize()))}
    for child in cluster.children:
        if child.alive():
            figures[child.name] = proc_rss_and_files(child.pid)
    return figures


def sample(cluster: Cluster, client: redis.Redis, started: float) -> str:
    figures = measure(cluster, client)
    memory, keys = figures.pop("redis")
    parts = [f"{time.time() - started:6.0f} s", f"redis {memory / 2**20:7.1f} MiB {keys:6d} keys"]
    parts += [f"{name} {rss / 2**20:6.1f} MiB {files:4d} fds" for name, (rss, files) in figures.items()]
    return " | ".join(parts)


class Growth:
    """Prints, every ``every`` URLs with an outcome, what each figure grew since the last checkpoint."""

    def __init__(self, every: int):
        self.every, self._next, self._last = every, every, None
        self._last_done = 0

    def check(self, done: int, cluster: Cluster, client: redis.Redis) -> None:
        if done < self._next:
            return
        figures = measure(cluster, client)
        if self._last is not None:
            per_1000 = 1000 / max(1, done - self._last_done)
            memory, keys = (now - before for now, before in zip(figures["redis"], self._last["redis"], strict=True))
            parts = [f"{done:7d} with outcome", f"redis {memory / 1024:+8.0f} KiB "
                     f"({memory * per_1000 / 1024:+6.1f} KiB per 1,000) {keys:+6d} keys"]
            parts += [f"{name} {(rss - self._last[name][0]) / 2**20:+6.1f} MiB "
                      f"{files - self._last[name][1]:+4d} fds"
                      for name, (rss, files) in figures.items() if name != "redis" and name in self._last]
            print("growth: " + " | ".join(parts), flush=True)
        else:
            print(f"growth: first checkpoint at {done} with outcome (warm-up); growth is measured from here",
                  flush=True)
        self._last, self._last_done = figures, done
        self._next = done - done % self.every + self.every


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--sources", type=int, default=24)
    parser.add_argument("--rate", type=float, default=60.0, help="summed limits, req/s")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--every", type=int, default=10_000,
                        help="print growth every this many URLs with an outcome")
    args = parser.parse_args()

    total = int(args.rate * args.minutes * 60)
    plan_behaviours = [Behaviour(**{**b.__dict__, "urls": total // args.sources})
                       for b in behaviours(args.sources, args.rate)]
    specs, plan = standard_web(args.sources, total, f"soak{uuid.uuid4().hex[:4]}s", plan_behaviours)
    folder = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    web = SimWeb(specs, log_path=folder / "requests.jsonl")
    print(f"{len(plan)} URLs over {args.minutes} min, {args.sources} sources, logs in {folder}")
    with LocalStack(folder / "stack") as stack, web.serving():
        env = {**os.environ, **crawler_env(stack.environment(), web.write_sources(folder / "sources.json")),
               "PYTHONPATH": str(ROOT)}
        client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
        with Outcomes(stack.kafka_hosts, [p.uuid for p in plan]) as outcomes, \
                Cluster(env, folder).start(args.workers) as cluster:
            started = time.time()
            per_slice = max(1, int(args.rate * FEED_EVERY))
            fed, next_sample, last_progress = 0, started, started
            growth = Growth(args.every)
            while fed < len(plan) or (not outcomes.done and time.time() < last_progress + STALL):
                if fed < len(plan) and time.time() >= started + fed / per_slice * FEED_EVERY:
                    cluster.schedule(write_tsv(web, plan[fed:fed + per_slice], folder / "slice.tsv"))
                    fed += per_slice
                if time.time() >= next_sample:
                    print(sample(cluster, client, started), flush=True)
                    next_sample += SAMPLE_EVERY
                if outcomes.poll(0.5):
                    last_progress = time.time()
                    growth.check(len(outcomes.kinds), cluster, client)
                dead = cluster.died()
                if dead:
                    raise SystemExit(f"{dead[0].name} died: see {dead[0].log_path}")
            print(sample(cluster, client, started))
            num_resized = int(client.get(NUM_RESIZED) or 0)
            if not outcomes.done:  # while the workers still hold their partitions
                left = unconsumed(stack.kafka_hosts)
                print(f"{len(left)} source-topic partitions not consumed to their end: {left[:10]}")
        reconcile(outcomes, plan, stack, num_resized)


def unconsumed(kafka_hosts: str) -> list[str]:
    """Source-topic partitions the workers' group has not committed to their end, with the
    member that owns each (none: no worker was assigned it, so its URLs were never read).
    tansu 0.6 reports a partition's end as its last batch's first offset + 1, so a partition
    read part way may pass for read; one never read (committed -1001) always shows."""
    admin = AdminClient({"bootstrap.servers": kafka_hosts})
    owners: dict[tuple[str, int], str] = {}
    try:
        group = admin.describe_consumer_groups([WORKER_GROUP])[WORKER_GROUP].result(30)
        for member in group.members:
            for tp in member.assignment.topic_partitions:
                owners[(tp.topic, tp.partition)] = member.client_id or member.member_id
    except KafkaException as exc:
        print(f"describe group failed: {exc}")
    topics = [t for t in admin.list_topics(timeout=30).topics if t == URLS_TOPIC]
    reader = Consumer(consumer_config(kafka_hosts, WORKER_GROUP))
    try:
        wanted = [TopicPartition(t, p) for t in topics
                  for p in admin.list_topics(t, timeout=30).topics[t].partitions]
        left = []
        for tp in reader.committed(wanted, timeout=60):
            end = reader.get_watermark_offsets(tp, timeout=30)[1]
            if max(tp.offset, 0) < end:
                left.append(f"{tp.topic}[{tp.partition}] committed {tp.offset} of {end}, owner "
                            f"{owners.get((tp.topic, tp.partition), 'none')}")
        return left
    finally:
        reader.close()


def reconcile(outcomes: Outcomes, plan: list, stack, num_resized: int) -> None:
    produced = len(plan)
    with_outcome = len(set(outcomes.kinds) & outcomes.wanted)
    quality_read = sum(k[QUALITY] for k in outcomes.kinds.values())
    print(f"outcomes per URL produced: {with_outcome / produced:.4f} ({with_outcome} of {produced}, "
          f"{produced - with_outcome} missing, {len(outcomes.gaps)} offset gaps in the reader); "
          f"duplicates {outcomes.duplicates()}, conflicts {len(outcomes.conflicts())}")
    print(f"num_resized {num_resized}, quality messages read {quality_read} "
          f"(a success counted without its message: {max(0, num_resized - quality_read)})")
    missing = outcomes.missing()
    if not missing:
        return
    with Outcomes(stack.kafka_hosts, missing) as again:
        again.wait(60.0)
    s3 = botocore.session.get_session().create_client("s3", endpoint_url=stack.s3_endpoint_url,
                                                      **DEV_CREDENTIALS)
    stored = sum(_exists(s3, stack.s3_bucket, f"{u}.jpg") for u in missing)
    print(f"{len(missing)} without an outcome: {len(again.kinds)} found by a second reader "
          f"(the first one missed them), {stored} have a thumbnail in S3 (the worker finished them); "
          f"e.g. {sorted(missing)[:5]}")
    print(f"outcomes per URL produced, with the second reader: "
          f"{(with_outcome + len(again.kinds)) / produced:.4f} ({with_outcome + len(again.kinds)} of {produced})")
    reached = outcomes.next_offsets()
    late = sum(offset >= reached.get((topic, partition), 0) for topic, partition, offset in again.found_at.values())
    print(f"of those, {late} were written past where the first reader had read (they came after it "
          f"stopped waiting), {len(again.found_at) - late} before (it skipped them); "
          f"where: {sorted(again.found_at.values())[:10]}; offset gaps in the first reader: {outcomes.gaps[:10]}")


def _exists(s3, bucket: str, key: str) -> bool:
    try:
        s3.head_object(Bucket=bucket, Key=key)
        return True
    except s3.exceptions.ClientError:
        return False


if __name__ == "__main__":
    main()
