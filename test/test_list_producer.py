"""``python -m url_lists.list_producer`` on a broker of its own and the session's Redis:
bad rows by number, sizes per site, and a producer SIGKILLed halfway then resumed.

Each test gets its own tansu (in memory, up in well under a second): the session's
broker is read by other tests' splitters, which would otherwise split these lists.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition
from redis import Redis

from common import contracts
from common.kafka import consumer_config
from devstack.servers import kafka_server
from test.test_crawl_e2e import assert_none_left
from url_lists.list_producer import POOL_MIN_ROWS, pool_processes

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def own_kafka(tmp_path: Path):
    server, hosts = kafka_server(tmp_path / "kafka")
    server.start()
    try:
        server.wait_ready()
        yield hosts
    finally:
        server.stop()


def inbound(hosts: str) -> list[tuple[bytes, dict]]:
    """Every (key, message) of inbound_images, from the start to its end."""
    consumer = Consumer(consumer_config(hosts, f"check-{os.urandom(4).hex()}", **{"enable.partition.eof": True}))
    partitions = consumer.list_topics(contracts.INBOUND_TOPIC, timeout=10).topics[contracts.INBOUND_TOPIC].partitions
    consumer.assign([TopicPartition(contracts.INBOUND_TOPIC, p, 0) for p in partitions])
    found, ended = [], set()
    deadline = time.monotonic() + 60
    while len(ended) < len(partitions) and time.monotonic() < deadline:
        for message in consumer.consume(10_000, 1.0):
            if message.error() is not None:
                assert message.error().code() == KafkaError._PARTITION_EOF, message.error()
                ended.add(message.partition())
                continue
            found.append((message.key(), json.loads(message.value())))
    consumer.close()
    return found


def run_producer(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "url_lists.list_producer", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_a_jsonl_list_becomes_messages_bad_rows_are_reported_and_sites_counted(
        own_kafka: str, stack_env: dict[str, str], redis_url: str, tmp_path: Path) -> None:
    env = {**stack_env, "KAFKA_HOSTS": own_kafka}
    lines = ['{"url": "https://img1.site1.co.uk/1.jpg", "caption": "a"}',
             '{"url": "img2.site1.co.uk/2.jpg"}',                 # no scheme
             '{"url": "ftp://site2.example/3.jpg"}',              # row 3: not http(s)
             'not json',                                          # row 4
             '', '{"url": "https://alice.github.io/5.jpg"}',      # row 5 blank, then row 6
             '{"caption": "no url"}',                             # row 7
             '{"url": "https://site1.co.uk/8.jpg"}']
    path = tmp_path / "list.jsonl"
    path.write_text("\n".join(lines) + "\n")
    done = run_producer(env, str(path), "--progress-file", str(tmp_path / "progress.json"))
    assert done.returncode == 0, done.stderr[-2000:]
    logged = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(e["file"], e["row"]) for e in logged if e["event"] == "list_bad_row"] == [
        (str(path), 3), (str(path), 4), (str(path), 7)]
    assert logged[-1]["event"] == "list_produced" and (logged[-1]["sent"], logged[-1]["bad_rows"]) == (4, 3)
    messages = [message for _, message in inbound(own_kafka)]
    assert sorted((m["url"], m["source"]) for m in messages) == [
        ("http://img2.site1.co.uk/2.jpg", "site1.co.uk"), ("https://alice.github.io/5.jpg", "alice.github.io"),
        ("https://img1.site1.co.uk/1.jpg", "site1.co.uk"), ("https://site1.co.uk/8.jpg", "site1.co.uk")]
    sizes = Redis.from_url(redis_url, decode_responses=True).hgetall(contracts.LIST_SOURCE_SIZES)
    assert sizes == {"site1.co.uk": "3", "alice.github.io": "1"}
    again = run_producer(env, str(path), "--progress-file", str(tmp_path / "progress.json"))
    assert again.returncode == 0 and "already produced" in again.stdout   # the same list: nothing twice
    assert len(inbound(own_kafka)) == 4


def test_killed_halfway_and_resumed_every_row_once(own_kafka: str, stack_env: dict[str, str],
                                                   redis_url: str, tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    env = {**stack_env, "KAFKA_HOSTS": own_kafka, "CRAWL_E2E_MARKER": marker}
    rows = 120_000
    path = tmp_path / "list.parquet"
    pq.write_table(pa.table({"url": [f"https://img{n % 3}.site{n % 50}.example/{n}.jpg" for n in range(rows)],
                             "caption": ["x"] * rows}), path, row_group_size=10_000)
    progress = tmp_path / "progress.json"
    argv = [sys.executable, "-m", "url_lists.list_producer", str(path), "--progress-file", str(progress),
            "--processes-count", "1"]
    redis = Redis.from_url(redis_url, decode_responses=True)
    first = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    # Sites are counted a batch at a time just before the batch is sent: past 20,000 rows it is
    # producing, whatever the machine's speed (the progress file may not have moved yet).
    while time.monotonic() < deadline and first.poll() is None:
        if sum(map(int, redis.hvals(contracts.LIST_SOURCE_SIZES))) > 20_000:
            break
        time.sleep(0.01)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert_none_left(marker)  # nor its pool: a killed producer leaves nothing running
    stopped_at = json.loads(progress.read_text())
    assert not stopped_at["done"] and stopped_at["next_row"] < rows, stopped_at
    done = run_producer(env, str(path), "--progress-file", str(progress))
    assert done.returncode == 0, done.stderr[-2000:]
    started = json.loads(done.stdout.splitlines()[0])
    assert started["resumed_at"] is not None, started
    keys = Counter(key for key, _ in inbound(own_kafka))
    assert len(keys) == rows and set(keys.values()) == {1}, f"{len(keys)} rows, repeats {keys.most_common(2)}"
    sizes = redis.hgetall(contracts.LIST_SOURCE_SIZES)
    assert sizes == {f"site{n}.example": str(rows // 50) for n in range(50)}   # each row counted once


@pytest.mark.parametrize("asked, rows_left, processes", [
    (None, 4_000, 0),                   # a short list: its own thread, no pool to start
    (None, POOL_MIN_ROWS - 1, 0),
    (None, POOL_MIN_ROWS, 2),           # a long one: one process per core
    (None, None, 2),                    # a length no one knows (a JSON array)
    (3, 4_000, 3),                      # asked for: as asked
    (0, 10_000_000, 0),
])
def test_a_pool_is_started_for_long_lists_or_when_asked(asked: int | None, rows_left: int | None,
                                                          processes: int) -> None:
    assert pool_processes(asked, rows_left, cores=2) == processes
