"""Hostile identifiers against the splitter's rules and the real S3 (issue 29): each one is
either refused at the splitter or stored exactly at its documented key in S3_BUCKET, and
nothing lands anywhere else (a second bucket the same credentials can write to stays empty);
and, on the real stack, such messages among ordinary ones slow none of them."""
from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from pathlib import Path

import pytest
from aiobotocore.session import get_session
from confluent_kafka import Producer

from common.contracts import INBOUND_TOPIC, REJECTED_TOPIC, identifier_of_key, thumbnail_key
from common.kafka import producer_config
from crawl_monitor.splitter import plan_batch
from demo.crawl import crawl
from demo.outcomes import QUALITY
from demo.simweb import Behaviour, SimWeb, standard_web
from devstack.servers import DEV_CREDENTIALS, create_bucket
from test.conftest import BUCKET
from test.test_e2e_crawl import crawl_env  # noqa: F401 - the fixture: a Kafka per crawl
from test.test_e2e_crawl import assert_outcomes, fail_if_dead, outcome_report
from test.test_e2e_faults import as_rejected_raw, collect_rejected
from test.hostile_ids import hostile_identifiers
from test.test_monitor_fakes import FakeMessage
from test.test_worker_thumbnails import s3_settings
from worker.imaging.thumbnails import s3_thumbnails

pytestmark = pytest.mark.paced  # runs by itself, after the rest (pytest.ini)

OTHER_BUCKET = "other"  # the bucket "../../other/owned" aims at
KEY_ALPHABET = re.compile(r"[A-Za-z0-9._~!-]+\.jpg")


async def all_objects(endpoint: str) -> dict[str, set[str]]:
    async with get_session().create_client("s3", endpoint_url=endpoint, **DEV_CREDENTIALS) as s3:
        found: dict[str, set[str]] = {}
        for bucket in (await s3.list_buckets())["Buckets"]:
            keys: set[str] = set()
            async for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket["Name"]):
                keys |= {item["Key"] for item in page.get("Contents", [])}
            found[bucket["Name"]] = keys
        return found


async def read(endpoint: str, keys: list[str]) -> list[bytes]:
    async with get_session().create_client("s3", endpoint_url=endpoint, **DEV_CREDENTIALS) as s3:
        async def one(key: str) -> bytes:
            response = await s3.get_object(Bucket=BUCKET, Key=key)
            return await response["Body"].read()
        return await asyncio.gather(*(one(key) for key in keys))


def split(identifiers: list[str]) -> tuple[list[str], dict[str, str]]:
    """What the splitter does with a message per identifier: (accepted, {refused: reason})."""
    messages = [FakeMessage(json.dumps({"url": "https://example.org/a.jpg", "uuid": identifier,
                                        "source": "example"}).encode(), n)
                for n, identifier in enumerate(identifiers)]
    plan = plan_batch(messages, INBOUND_TOPIC, 8)
    accepted = [json.loads(value)["uuid"] for topic, _, value, _ in plan.records if topic != REJECTED_TOPIC]
    refused = {}
    for topic, _, value, _ in plan.records:
        if topic == REJECTED_TOPIC:
            record = json.loads(value)
            refused[json.loads(record["raw"])["uuid"]] = record["error"]
    return accepted, refused


async def test_each_hostile_identifier_is_refused_or_stored_at_its_key_and_nowhere_else(
        s3_endpoint: str, unique: str) -> None:
    identifiers = hostile_identifiers()
    assert len(identifiers) >= 100
    accepted, refused = split(identifiers)
    assert sorted(accepted + list(refused)) == sorted(identifiers)  # each one, once
    assert all(reason for reason in refused.values())
    # What is refused: control and format characters, and keys past 255 bytes.
    assert set(refused) == {"a\u202eb", "a\u200bb", "a\u00a0b", "a\x00b", "a\nb", "é" * 200, "\U0001f600" * 200,
                            "字" * 113, "字" * 114, "%" * 200, "/" * 200, "\\" * 200, "../" * 66 + "ab"}
    assert "a" * 200 in accepted and "." * 200 in accepted
    keys = {identifier: thumbnail_key(identifier) for identifier in accepted}
    assert len(set(keys.values())) == len(keys), "two identifiers share a key"
    assert all(KEY_ALPHABET.fullmatch(key) and len(key) <= 255 for key in keys.values())
    assert all(identifier_of_key(key) == identifier for identifier, key in keys.items())
    assert keys["0b9f6a3e-4b0e-4c8e-9d5a-1f2e3d4c5b6a"] == "0b9f6a3e-4b0e-4c8e-9d5a-1f2e3d4c5b6a.jpg"

    create_bucket(s3_endpoint, OTHER_BUCKET)
    before = await all_objects(s3_endpoint)
    bodies = {identifier: f"{unique}:{n}".encode() for n, identifier in enumerate(accepted)}
    async with s3_thumbnails(s3_settings(s3_endpoint)) as thumbnails:
        await asyncio.gather(*(thumbnails.put(identifier, body) for identifier, body in bodies.items()))
    after = await all_objects(s3_endpoint)

    assert after[OTHER_BUCKET] == set(), "an identifier wrote into another bucket"
    new = {bucket: after[bucket] - before.get(bucket, set()) for bucket in after}
    assert {bucket for bucket, added in new.items() if added} <= {BUCKET}
    assert new[BUCKET] <= set(keys.values()), sorted(new[BUCKET] - set(keys.values()))[:5]
    assert await read(s3_endpoint, list(keys.values())) == list(bodies.values())


# Hostile identifiers among source A's ordinary URLs in the crawl below: the probes
# (S3 refused the first; the next three left the bucket), other spellings, and two the
# splitter refuses (a key past 255 bytes, a format character).
AMONG_ORDINARY = ["..\\x\\y", "../../other/owned", "../escape", "a/../../b", "%2e%2e%2fother%2fx",
                  "\uff0e\uff0e\uff0fother\uff0fy", "//host/x", "?acl", "#frag", "a" * 200,
                  "é" * 200, "a\u202eb"]
CRAWL_TIMEOUT = 60.0


def test_hostile_identifiers_among_ordinary_urls_end_once_and_slow_nothing(
        crawl_env, s3_endpoint: str, tmp_path: Path, unique: str) -> None:
    """Two sources of 10 URLs, one worker; the hostile messages are all source A's, and B gets
    as many with plain identifiers. A's ordinary URLs finish about when B's do; each hostile message ends in one
    outcome or one rejection; nothing lands outside S3_BUCKET. Before issue 29 one of them
    held the worker's crawl (31 of 40 URLs, then nothing), and one wrote into bucket ``other``."""
    create_bucket(s3_endpoint, OTHER_BUCKET)
    specs, plan = standard_web(2, 20, f"hid{unique[:6]}s", [Behaviour(rate=20, urls=10) for _ in range(2)])
    web = SimWeb(specs)
    source_a, source_b = (spec.name for spec in specs)
    image, image_b = (next(p for p in plan if p.source.lower() == name and QUALITY in p.expect)
                      for name in (source_a, source_b))
    refused = {"é" * 200, "a\u202eb"}
    started_ms = int(time.time() * 1000)
    finished: dict[str, float] = {}
    with crawl(web, plan, crawl_env, tmp_path, workers=1) as (cluster, outcomes):
        started = time.monotonic()
        hostile = [json.dumps({"url": web.sites[source_a].url(image.path), "uuid": identifier,
                               "source": source_a}).encode() for identifier in AMONG_ORDINARY]
        # As many more URLs for B, with plain identifiers: each source has the same requests to make.
        benign = {f"benign-{unique}-{n}": json.dumps({"url": web.sites[source_b].url(image_b.path),
                                                      "uuid": f"benign-{unique}-{n}", "source": source_b}).encode()
                  for n in range(len(AMONG_ORDINARY))}
        producer = Producer(producer_config(crawl_env["KAFKA_HOSTS"]))
        for raw_a, raw_b in zip(hostile, benign.values(), strict=True):
            producer.produce(INBOUND_TOPIC, value=raw_a)
            producer.produce(INBOUND_TOPIC, value=raw_b)
        assert producer.flush(30) == 0
        outcomes.wanted |= (set(AMONG_ORDINARY) - refused) | set(benign)
        deadline = started + CRAWL_TIMEOUT
        while not outcomes.done and time.monotonic() < deadline:
            outcomes.poll(0.5)
            fail_if_dead(cluster)(0)
            for identifier in outcomes.kinds:
                finished.setdefault(identifier, time.monotonic() - started)
        assert outcomes.done, outcome_report(outcomes, plan)
        wanted = Counter((INBOUND_TOPIC, as_rejected_raw(raw)) for raw in hostile
                         if json.loads(raw)["uuid"] in refused)
        rejected = collect_rejected(crawl_env["KAFKA_HOSTS"], wanted, started_ms, timeout=10.0)
    ordinary_a = max(finished[p.uuid] for p in plan if p.source.lower() == source_a)
    ordinary_b = max(finished[p.uuid] for p in plan if p.source.lower() == source_b)
    print(f"\n[hostile ids] ordinary URLs done: source A (with {len(hostile)} hostile) {ordinary_a:.1f} s, "
          f"source B (with {len(benign)} plain) {ordinary_b:.1f} s")
    assert ordinary_a <= 1.5 * ordinary_b + 5.0, (ordinary_a, ordinary_b)
    assert_outcomes(outcomes, plan)
    assert not outcomes.conflicts()
    assert all(outcomes.kind_of(identifier) == QUALITY for identifier in set(AMONG_ORDINARY) - refused)
    rejected_ids = {json.loads(raw)["uuid"] for topic, raw in rejected if topic == INBOUND_TOPIC}
    assert rejected_ids & set(AMONG_ORDINARY) == refused and sum(rejected.values()) == len(refused)
    stored = asyncio.run(all_objects(s3_endpoint))
    assert stored[OTHER_BUCKET] == set()
    assert {thumbnail_key(identifier) for identifier in set(AMONG_ORDINARY) - refused} <= stored[BUCKET]
