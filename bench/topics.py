"""What one topic per source costs the broker: ``python -m bench.topics --sources N``.

The measurement behind issue 26, which replaced the per-source topics with one keyed
``urls`` topic; kept to re-measure that choice. On the local stack's in-memory tansu:
the time to create N ``urls.*`` topics of 4 partitions (500 per request, as the splitter does), to read the
metadata of them all, to produce one message to each, and for one consumer
subscribed to all of them to be assigned its partitions and read the N
messages; then the same N messages through one topic of 64 partitions (the
alternative layout: sources hashed to partitions). Prints seconds per step.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from pathlib import Path

from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient

from common.kafka import TopicCreator, client_config, consumer_config, produce_waiting, producer_config
from devstack.stack import LocalStack


def timed(label: str, step) -> object:
    started = time.monotonic()
    result = step()
    print(f"{label:<58}{time.monotonic() - started:8.1f} s", flush=True)
    return result


def produce_one_each(hosts: str, topics: list[str], keyed: bool = False) -> None:
    producer = Producer(producer_config(hosts, **{"linger.ms": 50}))
    for n, topic in enumerate(topics if not keyed else ["urls_shared"] * len(topics)):
        value = json.dumps({"n": n}).encode()
        produce_waiting(producer, topic, value, key=f"source{n}" if keyed else None)
    assert producer.flush(600) == 0


def consume_all(hosts: str, subscription: list[str], expected: int, timeout: float) -> tuple[float, int]:
    """Seconds until the first assignment, and messages read within ``timeout``."""
    consumer = Consumer(consumer_config(hosts, f"bench-{uuid.uuid4().hex[:6]}"))
    assigned_at: list[float] = []
    started = time.monotonic()
    consumer.subscribe(subscription, on_assign=lambda c, parts: assigned_at.append(time.monotonic()))
    read = 0
    while read < expected and time.monotonic() - started < timeout:
        read += sum(1 for m in consumer.consume(1000, 0.5) if m.error() is None)
    consumer.close()
    return (assigned_at[0] - started if assigned_at else float("nan")), read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", type=int, default=1000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=180.0)
    args = parser.parse_args()
    topics = [f"urls.src{n:05d}" for n in range(args.sources)]
    with LocalStack(Path(tempfile.mkdtemp(prefix="bench-topics-"))) as stack:
        hosts = stack.kafka_hosts
        creator = TopicCreator(hosts, args.partitions)
        print(f"{args.sources} topics x {args.partitions} partitions on tansu (in memory)")

        def create() -> None:
            for start in range(0, len(topics), 500):
                assert not creator.create(topics[start:start + 500])
        timed("create the topics, 500 per request", create)
        admin = AdminClient(client_config(hosts))
        timed("metadata of every topic (one request)", lambda: admin.list_topics(timeout=120))
        timed("produce one message to each topic", lambda: produce_one_each(hosts, topics))
        assigned, read = timed("one consumer subscribed to all: assignment + read all",
                               lambda: consume_all(hosts, topics, len(topics), args.timeout))
        print(f"{'':<4}assigned after {assigned:.1f} s; read {read} of {len(topics)}")
        print("the alternative: one topic of 64 partitions, sources as keys")
        TopicCreator(hosts, 64).create(["urls_shared"])
        timed("produce the same messages to it", lambda: produce_one_each(hosts, topics, keyed=True))
        assigned, read = timed("one consumer: assignment + read all",
                               lambda: consume_all(hosts, ["urls_shared"], len(topics), args.timeout))
        print(f"{'':<4}assigned after {assigned:.1f} s; read {read} of {len(topics)}")


if __name__ == "__main__":
    main()
