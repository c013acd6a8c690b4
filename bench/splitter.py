"""Splitter throughput: ``python -m bench.splitter [N] [SOURCES]`` (defaults 200,000 and 20).

Starts the local stack, loads N inbound messages spread over SOURCES
sources, then runs the real splitter (validation, one topic per source
created on first sight, acknowledged produce, Redis counters, commit) until
every message is split, and prints one JSON line with messages/s. The
consumer group join is excluded from the steady-state figure. Run it on a
quiet machine: the load average is printed alongside, because the number
means little without it.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid

from confluent_kafka import Producer

from common import contracts
from common.kafka import ensure_topics, produce_waiting, producer_config
from common.settings import Settings
from crawl_monitor import splitter
from devstack.stack import LocalStack


def load(hosts: str, count: int, sources: int) -> float:
    """Fill ``inbound_images``; return messages/s of the load itself."""
    producer = Producer(producer_config(hosts, **{"linger.ms": 50}))
    started = time.perf_counter()
    for n in range(count):
        value = json.dumps({"url": f"https://images.example/{n}.jpg", "uuid": str(uuid.uuid4()),
                            "source": f"Source{n % sources}"}).encode()
        produce_waiting(producer, contracts.INBOUND_TOPIC, value)
    assert producer.flush(120) == 0, "the load did not complete"
    return count / (time.perf_counter() - started)


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    sources = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    with LocalStack() as addresses:
        settings = Settings(redis_url=addresses.redis_url, kafka_hosts=addresses.kafka_hosts)
        ensure_topics(settings.kafka_hosts, [contracts.INBOUND_TOPIC], 4)
        load_rate = load(settings.kafka_hosts, count, sources)
        load_before = os.getloadavg()[0]
        split = splitter.connect(settings)
        stop = threading.Event()
        done, batches, started, first_batch_done = 0, 0, time.perf_counter(), None
        try:
            while done < count:
                done += split.split_once(stop)
                batches += 1
                if first_batch_done is None and done:
                    first_batch_done, first_batch = time.perf_counter(), done
        finally:
            split.close()
        finished = time.perf_counter()
    steady = (done - first_batch) / (finished - first_batch_done) if finished > first_batch_done else 0.0
    print(json.dumps({
        "bench": "splitter", "messages": done, "sources": sources, "batches": batches,
        "seconds_with_group_join": round(finished - started, 2),
        "messages_per_s_steady": round(steady),
        "messages_per_s_overall": round(done / (finished - started)),
        "load_messages_per_s": round(load_rate),
        "load_average_1m_before": round(load_before, 2), "load_average_1m_after": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }))


if __name__ == "__main__":
    main()
