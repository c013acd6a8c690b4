"""Hostile identifiers against the splitter's rules and the real S3 (issue 29): each one is
either refused at the splitter or stored exactly at its documented key in S3_BUCKET, and
nothing lands anywhere else (a second bucket the same credentials can write to stays empty)."""
from __future__ import annotations

import asyncio
import json
import re

from aiobotocore.session import get_session

from common.contracts import INBOUND_TOPIC, REJECTED_TOPIC, identifier_of_key, thumbnail_key
from crawl_monitor.splitter import plan_batch
from devstack.servers import DEV_CREDENTIALS, create_bucket
from test.conftest import BUCKET
from test.hostile_ids import hostile_identifiers
from test.test_monitor_fakes import FakeMessage
from test.test_worker_thumbnails import s3_settings
from worker.thumbnails import s3_thumbnails

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
    plan = plan_batch(messages, INBOUND_TOPIC)
    accepted = [json.loads(value)["uuid"] for topic, _, value in plan.records if topic != REJECTED_TOPIC]
    refused = {}
    for topic, _, value in plan.records:
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
