"""Hostile identifiers among ordinary URLs (issue 29): ``python -m bench.hostile_ids [WORKERS]``.

The two probes of issue 29, side by side in one run on a fresh local stack (each
crawl with a Kafka of its own): 40 ordinary URLs of two sources at 2 req/s,
first alone, then with each probe's hostile identifiers (``STALL``, ``ESCAPE``;
their URLs are ordinary images of the first source). A second bucket, ``other``, which the
same credentials can write to, is created first. One JSON line per crawl:

- ``ordinary_at_15s`` / ``ordinary_at_60s``: ordinary URLs with an outcome that long
  after scheduling; ``all_ordinary_s``: when the last one came (null: not in 60 s);
- ``site_requests``: requests the two sites saw;
- ``hostile``: each hostile identifier's outcome kinds, or ``rejected``;
- ``outside_bucket``: every object in a bucket other than S3_BUCKET;
  ``other_keys_in_bucket``: new keys in S3_BUCKET that are no ordinary ``{uuid}.jpg``;
  ``at_documented_key``: the hostile identifiers whose ``thumbnail_key`` holds an object.

Run it on a quiet machine; the load average is printed alongside.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import uuid as uuidlib
from pathlib import Path
from typing import Any

import botocore.session
import redis
from confluent_kafka import Consumer, Producer

from common.contracts import INBOUND_TOPIC, REJECTED_TOPIC, thumbnail_key
from common.kafka import consumer_config, producer_config
from demo.crawl import crawl
from demo.outcomes import QUALITY
from demo.simweb import Behaviour, SimWeb, standard_web
from devstack.servers import DEV_CREDENTIALS, create_bucket, kafka_server
from devstack.stack import LocalStack

# The two probes: S3 refused the first one's key (the crawl stalled); the others left the bucket.
STALL = ("..\\x\\y",)
ESCAPE = ("../../other/owned", "../escape", "a/../../b")
OTHER_BUCKET = "other"
URLS_PER_SOURCE = 20
RATE = 2.0
WINDOW = 60.0


def objects(endpoint: str) -> dict[str, list[str]]:
    """Every key of every bucket (but tansu's, if any)."""
    s3 = botocore.session.get_session().create_client("s3", endpoint_url=endpoint, **DEV_CREDENTIALS)
    found: dict[str, list[str]] = {}
    for bucket in s3.list_buckets()["Buckets"]:
        name = bucket["Name"]
        keys: list[str] = []
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys += [item["Key"] for item in page.get("Contents", [])]
        found[name] = keys
    return found


def rejected_uuids(hosts: str, wanted: set[str]) -> set[str]:
    """The wanted uuids that have a rejected_messages record."""
    consumer = Consumer(consumer_config(hosts, f"bench-rejected-{uuidlib.uuid4().hex}"))
    consumer.subscribe([REJECTED_TOPIC])
    found: set[str] = set()
    deadline = time.monotonic() + 5.0
    try:
        while time.monotonic() < deadline:
            for message in consumer.consume(500, 0.5):
                if message.error():
                    continue
                try:
                    raw = json.loads(json.loads(message.value())["raw"])
                except (ValueError, KeyError, TypeError):
                    continue
                if isinstance(raw, dict) and raw.get("uuid") in wanted:
                    found.add(raw["uuid"])
    finally:
        consumer.close()
    return found


def one_crawl(label: str, stack: Any, folder: Path, workers: int, hostile: tuple[str, ...]) -> dict[str, Any]:
    redis.Redis.from_url(stack.redis_url).flushdb()
    kafka, hosts = kafka_server(folder / label / "kafka")
    kafka.start()
    try:
        kafka.wait_ready()
        env = {**stack.environment(), "KAFKA_HOSTS": hosts}
        prefix = f"{label}{uuidlib.uuid4().hex[:6]}s"
        specs, plan = standard_web(2, 2 * URLS_PER_SOURCE, prefix,
                                   [Behaviour(rate=RATE, urls=URLS_PER_SOURCE) for _ in range(2)])
        web = SimWeb(specs)
        image = next(p for p in plan if QUALITY in p.expect)
        before = {bucket: set(keys) for bucket, keys in objects(stack.s3_endpoint_url).items()}
        ordinary = {p.uuid for p in plan}
        with crawl(web, plan, env, folder / label, workers) as (cluster, outcomes):
            started = time.monotonic()
            producer = Producer(producer_config(hosts))
            url = web.sites[image.source.lower()].url(image.path)
            for identifier in hostile:
                producer.produce(INBOUND_TOPIC, json.dumps({"url": url, "uuid": identifier,
                                                           "source": image.source}).encode())
            assert producer.flush(30) == 0
            outcomes.wanted |= set(hostile)
            at: dict[float, int] = {}
            last = None
            while time.monotonic() - started < WINDOW:
                outcomes.poll(0.5)
                done = len(ordinary & set(outcomes.kinds))
                for mark in (15.0, WINDOW):
                    if mark not in at and time.monotonic() - started >= mark:
                        at[mark] = done
                if done == len(ordinary) and last is None:
                    last = time.monotonic() - started
                if last is not None and all(h in outcomes.kinds for h in hostile):
                    break
            at.setdefault(15.0, len(ordinary & set(outcomes.kinds)))
            at.setdefault(WINDOW, len(ordinary & set(outcomes.kinds)))
            rejected = rejected_uuids(hosts, set(hostile))
            site_requests = len([r for r in web.all_requests() if not r.path.startswith("/robots.txt")])
        after = objects(stack.s3_endpoint_url)
    finally:
        kafka.stop()
    new = {bucket: sorted(set(keys) - before.get(bucket, set())) for bucket, keys in after.items()}
    return {
        "crawl": label, "hostile_messages": len(hostile), "ordinary": len(ordinary),
        "ordinary_at_15s": at[15.0], "ordinary_at_60s": at[WINDOW],
        "all_ordinary_s": None if last is None else round(last, 1),
        "site_requests": site_requests,
        "hostile": {h: sorted(outcomes.kinds.get(h, {})) + (["rejected"] if h in rejected else []) for h in hostile},
        "outside_bucket": {bucket: keys for bucket, keys in new.items() if bucket != stack.s3_bucket and keys},
        "other_keys_in_bucket": [k for k in new.get(stack.s3_bucket, []) if k[:-len(".jpg")] not in ordinary],
        "at_documented_key": [h for h in hostile if thumbnail_key(h) in new.get(stack.s3_bucket, [])],
        "load_average": os.getloadavg()[0],
    }


def main() -> None:
    workers = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    folder = Path(tempfile.mkdtemp(prefix="bench-hostile-"))
    with LocalStack(folder / "stack") as stack:
        create_bucket(stack.s3_endpoint_url, OTHER_BUCKET)
        for label, hostile in (("plain", ()), ("stall", STALL), ("escape", ESCAPE)):
            print(json.dumps(one_crawl(label, stack, folder, workers, hostile)), flush=True)
    print(json.dumps({"logs": str(folder)}))


if __name__ == "__main__":
    main()
