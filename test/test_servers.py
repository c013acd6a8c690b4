"""Each real server does what the crawler relies on it for."""
from __future__ import annotations

import asyncio
import json
import time

from confluent_kafka import Consumer, Producer
from aiobotocore.session import get_session

from common.kafka import consumer_config, producer_config
from devstack.servers import DEV_CREDENTIALS, LISTEN_PORTS_LOWEST, free_port
from test.conftest import BUCKET


async def test_redis_token_decr_semantics(redis_client) -> None:
    """A worker may fetch only while DECR leaves the bucket at 0 or above."""
    key = "currtokens:example"
    assert await redis_client.decr(key) == -1  # a missing bucket is empty: fail closed
    await redis_client.set(key, 3)
    results = await asyncio.gather(*(redis_client.decr(key) for _ in range(5)))
    granted = [r for r in results if r >= 0]
    assert sorted(results) == [-2, -1, 0, 1, 2]
    assert len(granted) == 3


def test_kafka_produce_consume_commit_round_trip(kafka_hosts: str, unique: str) -> None:
    topic, group = f"roundtrip.{unique}", f"group-{unique}"
    producer = Producer(producer_config(kafka_hosts))
    sent = [json.dumps({"n": n}).encode() for n in range(20)]
    for value in sent:
        producer.produce(topic, value)
    assert producer.flush(30) == 0

    def drain(expect: int, seconds: float) -> list[bytes]:
        consumer = Consumer(consumer_config(kafka_hosts, group))
        consumer.subscribe([topic])
        got: list[bytes] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and (expect == 0 or len(got) < expect):
            for msg in consumer.consume(100, 0.5):
                if not msg.error():
                    got.append(msg.value())
        if got:
            consumer.commit(asynchronous=False)
        consumer.close()
        return got

    assert sorted(drain(len(sent), 60)) == sorted(sent)
    assert drain(0, 8) == []  # committed: a new member of the group sees nothing again


async def test_s3_put_get_list(s3_endpoint: str, unique: str) -> None:
    session = get_session()
    async with session.create_client("s3", endpoint_url=s3_endpoint, **DEV_CREDENTIALS) as s3:
        key = f"{unique}.jpg"
        await s3.put_object(Bucket=BUCKET, Key=key, Body=b"\xff\xd8thumb", ContentType="image/jpeg")
        response = await s3.get_object(Bucket=BUCKET, Key=key)
        async with response["Body"] as body:
            assert await body.read() == b"\xff\xd8thumb"
        listing = await s3.list_objects_v2(Bucket=BUCKET, Prefix=unique)
        assert [obj["Key"] for obj in listing["Contents"]] == [key]


def test_the_servers_ports_are_below_the_range_of_outgoing_connections() -> None:
    """An outgoing connection cannot take a server's port between its choice and the server's bind."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {free_port() for _ in range(50)}
    assert all(LISTEN_PORTS_LOWEST <= port < low for port in ports) and len(ports) > 40
