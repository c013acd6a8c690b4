"""The monitor on the real servers: splitting, restarts, a crash before the commit, the TSV
producer, and the operator's runbook typed into redis-cli against a running monitor.

Kafka is shared by the whole session, so each test splits its own inbound
topic with its own consumer group, names its sources with ``unique`` and
filters what it reads by them.
"""
from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from collections.abc import Callable

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from redis import Redis

from common import contracts
from common.kafka import consumer_config, ensure_topics, list_topics, producer_config
from common.settings import Settings
from crawl_monitor import splitter

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def wait_for(condition: Callable[[], object], timeout: float = 60.0, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def produce(hosts: str, topic: str, values: list[bytes]) -> None:
    producer = Producer(producer_config(hosts))
    for value in values:
        producer.produce(topic, value)
        producer.poll(0)
    assert producer.flush(30) == 0


def read(hosts: str, topics: list[str], keep: Callable[[dict], bool], expected: int,
         settle: float = 1.0, timeout: float = 60.0) -> list[dict]:
    """Every kept message of ``topics`` from the start; reads on ``settle`` s past ``expected``
    so that duplicates would show. Partitions are assigned, not subscribed: no group join to wait for."""
    partitions = list_topics(hosts)
    consumer = Consumer(consumer_config(hosts, f"reader-{os.urandom(6).hex()}"))
    consumer.assign([TopicPartition(topic, partition, OFFSET_BEGINNING)
                     for topic in topics for partition in range(partitions[topic])])
    found: list[dict] = []
    deadline, quiet_until = time.monotonic() + timeout, None
    try:
        while time.monotonic() < deadline and (quiet_until is None or time.monotonic() < quiet_until):
            for message in consumer.consume(1000, 0.5):
                if message.error() is None:
                    value = json.loads(message.value())
                    if keep(value):
                        found.append(value)
            if quiet_until is None and len(found) >= expected:
                quiet_until = time.monotonic() + settle
    finally:
        consumer.close()
    return found


class RunningSplitter:
    """The real splitter on its own thread, as the monitor runs it."""

    def __init__(self, settings: Settings, inbound: str, group: str):
        self._stop = threading.Event()
        self._splitter = splitter.connect(settings, inbound_topic=inbound, group=group)
        self._thread = threading.Thread(target=self._splitter.run, args=(self._stop,), daemon=True)

    def __enter__(self) -> RunningSplitter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self._splitter.close()


def good(unique: str, n: int, sources: int = 5) -> bytes:
    return json.dumps({"url": f"https://img.example/{unique}/{n}.jpg", "uuid": f"{unique}-{n}",
                       "source": f"Mon{unique}S{n % sources}"}).encode()


@pytest.fixture
def settings(redis_url: str, kafka_hosts: str) -> Settings:
    return Settings(redis_url=redis_url, kafka_hosts=kafka_hosts)


def test_split_rejects_and_restart_each_message_once(settings: Settings, unique: str) -> None:
    hosts = settings.kafka_hosts
    inbound, group = f"inbound_test_{unique}", f"splitter-{unique}"
    ensure_topics(hosts, [inbound], 4)
    malformed = [f"not json {unique} {n}".encode() if n % 2 else
                 json.dumps({"url": f"ftp://x/{unique}/{n}", "uuid": "u", "source": "s"}).encode()
                 for n in range(50)]
    good_ones = [good(unique, n) for n in range(950)]
    produce(hosts, inbound, good_ones[:500] + malformed + good_ones[500:])
    redis = Redis.from_url(settings.redis_url, decode_responses=True)

    with RunningSplitter(settings, inbound, group):
        wait_for(lambda: redis.get(contracts.NUM_SPLIT) == "950", what="950 split")
    # Stopped: more arrive while no splitter runs; a new one takes over from the commit.
    produce(hosts, inbound, [good(unique, n) for n in range(950, 1150)])
    with RunningSplitter(settings, inbound, group):
        wait_for(lambda: redis.get(contracts.NUM_SPLIT) == "1150", what="1150 split")

    split = read(hosts, [contracts.URLS_TOPIC], lambda m: m["uuid"].startswith(unique), 1150)
    assert sorted(collections.Counter(m["uuid"] for m in split).values()) == [1] * 1150
    assert {m["source"] for m in split} == {f"mon{unique}s{i}" for i in range(5)}
    rejected = read(hosts, [contracts.REJECTED_TOPIC], lambda m: unique in m["raw"], 50)
    assert len(rejected) == 50 and all(m["topic"] == inbound and m["error"] for m in rejected)
    assert redis.smembers(contracts.INBOUND_SOURCES) == {f"mon{unique}s{i}" for i in range(5)}
    redis.close()


CRASHING_SPLITTER = """
import os, sys, threading
from common.settings import Settings
from crawl_monitor import splitter

class CrashingConsumer(splitter.Consumer):
    def commit(self, *args, **kwargs):
        os._exit(9)  # the broker has acknowledged the batch; the commit never happens

splitter.Consumer = CrashingConsumer
settings = Settings(redis_url=sys.argv[1], kafka_hosts=sys.argv[2])
splitter.connect(settings, inbound_topic=sys.argv[3], group=sys.argv[4]).run(threading.Event())
"""


def test_a_splitter_killed_between_produce_and_commit_re_splits(
        settings: Settings, unique: str, tmp_path: Path, stack_env: dict[str, str]) -> None:
    hosts = settings.kafka_hosts
    inbound, group = f"inbound_test_{unique}", f"splitter-{unique}"
    ensure_topics(hosts, [inbound], 4)
    produce(hosts, inbound, [good(unique, n) for n in range(300)])
    script = tmp_path / "crashing_splitter.py"
    script.write_text(CRASHING_SPLITTER)
    crashed = subprocess.run([PYTHON, str(script), settings.redis_url, hosts, inbound, group],
                             env=stack_env, cwd=ROOT, capture_output=True, timeout=90)
    assert crashed.returncode == 9, crashed.stderr.decode()[-2000:]
    redis = Redis.from_url(settings.redis_url, decode_responses=True)
    first_pass = int(redis.get(contracts.NUM_SPLIT) or 0)
    assert first_pass > 0  # produced and counted, but not committed

    with RunningSplitter(settings, inbound, group):
        wait_for(lambda: int(redis.get(contracts.NUM_SPLIT) or 0) >= 300 + first_pass, what="everything split")
    counts = collections.Counter(m["uuid"] for m in read(hosts, [contracts.URLS_TOPIC],
                                                         lambda m: m["uuid"].startswith(unique), 300 + first_pass))
    assert set(counts) == {f"{unique}-{n}" for n in range(300)}  # nothing lost
    assert sum(counts.values()) >= 300 + first_pass  # the crashed batch went out (at least) twice
    redis.close()


def test_tsv_producer_end_to_end(kafka_hosts: str, unique: str, tmp_path: Path, stack_env: dict[str, str]) -> None:
    rows = [
        b"identifier\tsource\turl\tlicense",
        f"{unique}-1\tflickr\thttps://a.example/1.jpg\tby".encode(),
        f"{unique}-2\tMet\timages.example/2.jpg\tby".encode(),       # no scheme: http:// added
        f"{unique}-3\t\thttps://a.example/3.jpg\tby".encode(),       # line 4: no source
        f"{unique}-4\tflickr\tftp://a.example/4.jpg\tby".encode(),   # line 5: not http(s)
        f"{unique}-5\tflickr".encode(),                              # line 6: short row
        f"{unique}-6\tflickr\thttps://a.example/\xff.jpg\tby".encode("latin-1"),  # line 7: not UTF-8
        f"{unique}-7\tbad source!\thttps://a.example/7.jpg\tby".encode(),  # line 8
        f"{unique}-8\tphylopic\t//c.example/8.png\tby".encode(),
    ]
    path = tmp_path / "urls.tsv"
    path.write_bytes(b"\n".join(rows) + b"\n")
    done = subprocess.run([PYTHON, "-m", "url_lists.tsv_producer", str(path), kafka_hosts],
                          env=stack_env, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    logged = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(e["event"], e["line"]) for e in logged if e["event"] == "tsv_bad_row"] == [
        ("tsv_bad_row", line) for line in (4, 5, 6, 7, 8)]
    assert logged[-1]["event"] == "tsv_produced"
    assert (logged[-1]["sent"], logged[-1]["delivered"], logged[-1]["bad_rows"], logged[-1]["failed"]) == (3, 3, 5, 0)
    assert "\r" not in done.stderr  # no progress bar when not on a terminal

    sent = read(kafka_hosts, [contracts.INBOUND_TOPIC], lambda m: m.get("uuid", "").startswith(unique), 3)
    assert sorted((m["uuid"], m["url"], m["source"]) for m in sent) == [
        (f"{unique}-1", "https://a.example/1.jpg", "flickr"),
        (f"{unique}-2", "http://images.example/2.jpg", "Met"),
        (f"{unique}-8", "http://c.example/8.png", "phylopic"),
    ]


def test_tsv_producer_refuses_a_file_without_the_columns(kafka_hosts: str, tmp_path: Path,
                                                        stack_env: dict[str, str]) -> None:
    path = tmp_path / "bad.tsv"
    path.write_text("link\tid\nhttp://a/b.jpg\t1\n")
    done = subprocess.run([PYTHON, "-m", "url_lists.tsv_producer", str(path), kafka_hosts],
                          env=stack_env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "url" in done.stderr and "Traceback" not in done.stderr


class MonitorProcess:
    """``python -m crawl_monitor`` with its stdout collected line by line."""

    def __init__(self, env: dict[str, str]):
        self.process = subprocess.Popen([PYTHON, "-m", "crawl_monitor"], env=env, cwd=ROOT, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: list[dict] = []
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        for line in self.process.stdout:
            self.lines.append(json.loads(line))

    def events(self, name: str) -> list[dict]:
        return [line for line in list(self.lines) if line["event"] == name]

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(40)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()


def redis_cli(redis_url: str, *command: str) -> str:
    done = subprocess.run(["/usr/bin/redis-cli", "-u", redis_url, *command],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_monitor_halts_a_failing_source_and_the_operator_runbook_resumes_it(
        stack_env: dict[str, str], redis_url: str, kafka_hosts: str, unique: str, tmp_path: Path) -> None:
    source = f"op{unique}"
    sources = tmp_path / "sources.json"
    sources.write_text(json.dumps([{"source_name": source, "image_count": 500_000_000}]))
    redis = Redis.from_url(redis_url, decode_responses=True)
    # A worker waits for the source's tokens throughout: the monitor grants only active sources (issue 26).
    redis.zadd(contracts.ACTIVE_SOURCES, {source: time.time() + 3600})
    monitor = MonitorProcess({**stack_env, "SOURCES_URL": str(sources)})
    try:
        # A source new to the monitor gets a tenth of its computed rate (the adaptive back-off's
        # slow start); with adaptation switched off, as the runbook says, all of it.
        wait_for(lambda: redis.get(contracts.tokens_key(source)) == "20", what="the slow start")
        assert redis_cli(redis_url, "set", f"adaptive_off:{source}", "1") == "OK"
        wait_for(lambda: redis.get(contracts.tokens_key(source)) == "200", what="the computed rate")
        assert 0 < redis.pttl(contracts.tokens_key(source)) <= 2000  # a killed monitor leaves no tokens for long
        # A URL for the source goes through the monitor's own splitter.
        produce(kafka_hosts, contracts.INBOUND_TOPIC, [json.dumps(
            {"url": "https://op.example/1.jpg", "uuid": f"{unique}-1", "source": source.upper()}).encode()])
        wait_for(lambda: redis.sismember(contracts.INBOUND_SOURCES, source), what="the source split")

        # What workers leave after 50 failed requests: the statuses, and the source marked active.
        redis.rpush(contracts.last_50_key(source), *["503"] * 50)
        redis.zadd(contracts.ACTIVE_SOURCES, {source: time.time()})
        wait_for(lambda: redis.get(contracts.tokens_key(source)) == "0", what="the halt")
        halted = wait_for(lambda: monitor.events(contracts.EVENT_CRAWL_HALTED), what="crawl_halted")
        assert halted[0]["type"] == "permanent" and halted[0]["source"] == source

        # The runbook, verbatim.
        assert source in redis_cli(redis_url, "smembers", "halted").splitlines()
        assert redis_cli(redis_url, "set", f"override_rate:{source}", "5") == "OK"
        assert redis_cli(redis_url, "del", f"statuslast50req:{source}") == "1"
        assert redis_cli(redis_url, "srem", "halted", source) == "1"
        wait_for(lambda: redis.get(contracts.tokens_key(source)) == "5", what="the override after release")
        assert float(redis.get(contracts.rate_limit_key(source))) == 5.0

        update = wait_for(lambda: [u for u in monitor.events(contracts.EVENT_MONITORING_UPDATE)
                                   if source in u["specific"]], what="a monitoring update")[-1]
        assert set(update) == {"event", "time", "general", "specific"}
        assert set(update["general"]) == {"global_max_rps", "error_rps", "processing_rate", "success_rps",
                                          "circuit_breaker_tripped", "num_resized", "resize_errors", "split_rate",
                                          "sources_total", "sources_listed", "sources_stopped", "opted_out"}
        assert set(update["specific"][source]) == {"successful", "error", "last_50_statuses", "rate_limit", "limit",
                                                   "ceiling", "effective_rate", "response_ms", "backlog", "opted_out"}
    finally:
        returncode = monitor.stop()
    assert returncode == 0, monitor.process.stderr.read()[-2000:]
    assert redis.get(contracts.tokens_key(source)) is None  # emptied on the way out
    assert redis.sismember(contracts.HALTED, source) == 0
    redis.close()


def test_a_second_monitor_stands_by_and_takes_over_when_the_first_stops(
        stack_env: dict[str, str], redis_url: str, unique: str, tmp_path: Path) -> None:
    """Two monitors at once would refill every bucket twice a second: the second one waits."""
    source = f"lease{unique}"
    sources = tmp_path / "sources.json"
    sources.write_text(json.dumps([{"source_name": source, "image_count": 500_000_000}]))
    env = {**stack_env, "SOURCES_URL": str(sources)}
    redis = Redis.from_url(redis_url, decode_responses=True)
    redis.zadd(contracts.ACTIVE_SOURCES, {source: time.time() + 3600})  # a worker waits for its tokens
    first = MonitorProcess(env)
    second = None
    try:
        wait_for(lambda: first.events(contracts.EVENT_MONITOR_STARTED), what="the first monitor")
        second = MonitorProcess(env)
        standby = wait_for(lambda: second.events(contracts.EVENT_MONITOR_STANDBY), what="the standby")
        assert standby[0]["active"] == first.events(contracts.EVENT_MONITOR_STARTED)[0]["lease_holder"]
        time.sleep(2)
        assert not second.events(contracts.EVENT_MONITOR_STARTED)
        assert first.stop() == 0
        stopped = time.monotonic()
        wait_for(lambda: second.events(contracts.EVENT_MONITOR_STARTED), what="the takeover")
        assert time.monotonic() - stopped < 3  # handed over, not left to expire
        # The second continues the first's adaptive state: still the slow start's tenth of 200.
        wait_for(lambda: redis.get(contracts.tokens_key(source)) == "20", what="buckets from the second")
    finally:
        first.stop()
        if second is not None:
            assert second.stop() == 0, second.process.stderr.read()[-2000:]
    assert redis.get(contracts.MONITOR_LEASE) is None
    redis.close()
