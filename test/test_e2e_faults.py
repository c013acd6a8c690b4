"""The system under faults, on the real stack with real subprocesses.

A worker SIGKILLed mid-crawl, Redis, the broker and S3 restarted mid-crawl,
the monitor stopped and restarted, every worker stopped together and one
started, and a flood of hostile inbound messages. The crawls here use
well-behaved sites (no random 500s or 429s) so every URL has one right
outcome, and are sized to last ~17 s undisturbed.
"""
from __future__ import annotations

import json
import random
import signal
import string
import time
from collections import Counter
from pathlib import Path

from confluent_kafka import Consumer, Producer

from common.contracts import INBOUND_TOPIC, MAX_REJECTED_RAW_BYTES, REJECTED_TOPIC, URLS_TOPIC, parse_crawl_request
from common.kafka import consumer_config, producer_config
from demo.crawl import crawl
from demo.outcomes import QUALITY
from devstack.servers import DEV_CREDENTIALS, free_port, kafka_server, redis_server, s3_server
from test.conftest import BUCKET
from demo.simweb import DISALLOW_PRIVATE, Behaviour, SimWeb, fetches, standard_web, write_tsv
from test.test_e2e_crawl import crawl_env  # noqa: F401 - the fixture: a Kafka per crawl
from test.test_e2e_crawl import assert_outcomes, assert_polite, fail_if_dead, outcome_report

WORKERS = 2
TIMEOUT = 150.0
STOP_WITHIN = 2.0     # seconds from stopping the monitor to the last request the sites see
MONITOR_DOWN = 5.0    # seconds the monitor stays stopped
REDIS_DOWN = 4.0


def fault_web(prefix: str, log_dir: Path, urls_per_source: int = 100) -> tuple[SimWeb, list]:
    """Four clean sources at 6 req/s: ~17 s of crawling for 400 URLs, limits binding."""
    behaviours = [Behaviour(rate=6, urls=urls_per_source, latency=0.02 * i,
                            robots_txt=DISALLOW_PRIVATE if i % 2 else None) for i in range(4)]
    specs, plan = standard_web(len(behaviours), len(behaviours) * urls_per_source, prefix, behaviours)
    return SimWeb(specs, log_path=log_dir / "requests.jsonl"), plan


def requests_between(web: SimWeb, start: float, end: float) -> list:
    return [r for r in web.all_requests() if start < r.time < end]


def test_sigkill_one_of_two_workers_mid_crawl(crawl_env, tmp_path: Path, unique: str) -> None:
    web, plan = fault_web(f"kill{unique[:6]}s", tmp_path)
    with crawl(web, plan, crawl_env, tmp_path, WORKERS) as (cluster, outcomes):
        assert outcomes.wait(TIMEOUT, fail_if_dead(cluster), until=len(plan) // 3), outcome_report(outcomes, plan)
        victim = next(c for c in cluster.children if c.name == "worker-1")
        assert victim.stop(signal.SIGKILL) == -signal.SIGKILL
        outcomes.wait(TIMEOUT, fail_if_dead(cluster))
    print(f"\n[kill] duplicates after the SIGKILL: {outcomes.duplicates()}")
    assert_outcomes(outcomes, plan)
    assert_polite(web, WORKERS)


def test_redis_restart_mid_crawl_workers_wait_and_recover(crawl_env, tmp_path: Path, unique: str) -> None:
    """The crawl's own Redis on a fixed port, stopped and started again (empty: no persistence)."""
    server, redis_url = redis_server(tmp_path / "redis", port=free_port())
    server.start()
    try:
        server.wait_ready()
        web, plan = fault_web(f"redis{unique[:6]}s", tmp_path)
        with crawl(web, plan, {**crawl_env, "REDIS_URL": redis_url}, tmp_path, WORKERS) as (cluster, outcomes):
            assert outcomes.wait(TIMEOUT, fail_if_dead(cluster), until=len(plan) // 3), \
                outcome_report(outcomes, plan)
            server.stop()
            stopped = time.time()
            time.sleep(REDIS_DOWN)
            restarted = time.time()
            server.start()
            server.wait_ready()
            outcomes.wait(TIMEOUT, fail_if_dead(cluster))
    finally:
        server.stop()
    during = requests_between(web, stopped + STOP_WITHIN, restarted)
    assert not during, f"{len(during)} requests while Redis was down (no tokens), e.g. {during[:3]}"
    assert_outcomes(outcomes, plan)  # images still end as quality: waiting, not failing
    # Redis forgot the robots.txt cache, so each site may be asked once more.
    assert_polite(web, WORKERS, robots_fetches=2)


def test_monitor_stopped_requests_stop_then_resume(crawl_env, tmp_path: Path, unique: str) -> None:
    """Once with SIGTERM (buckets emptied on the way out), once with SIGKILL (buckets expire)."""
    web, plan = fault_web(f"mon{unique[:6]}s", tmp_path)
    pauses = []
    with crawl(web, plan, crawl_env, tmp_path, WORKERS) as (cluster, outcomes):
        for fraction, signum in ((0.25, signal.SIGTERM), (0.55, signal.SIGKILL)):
            assert outcomes.wait(TIMEOUT, fail_if_dead(cluster), until=int(len(plan) * fraction)), \
                outcome_report(outcomes, plan)
            monitor = next(c for c in cluster.children if c.name == "monitor" and c.alive())
            stopped = time.time()
            assert monitor.stop(signum) is not None
            time.sleep(MONITOR_DOWN)
            restarted = time.time()
            cluster.start_monitor()
            pauses.append((signal.Signals(signum).name, stopped, restarted))
        outcomes.wait(TIMEOUT, fail_if_dead(cluster))
    for name, stopped, restarted in pauses:
        late = requests_between(web, stopped + STOP_WITHIN, restarted)
        assert not late, f"{name}: {len(late)} requests over {STOP_WITHIN} s after the monitor stopped"
        assert requests_between(web, restarted, restarted + 30), f"{name}: no requests after the restart"
    assert_outcomes(outcomes, plan)
    assert_polite(web, WORKERS)


BROKER_DOWN = 3.0
S3_DOWN = 10.0


def test_broker_restart_mid_crawl_loses_nothing(crawl_env, s3_endpoint: str, tmp_path: Path, unique: str) -> None:
    """The durable broker of ``make stack`` (tansu on the stack's S3), restarted on its port:
    topics, queued URLs and committed offsets survive, and every process rides it out."""
    broker, hosts = kafka_server(tmp_path / "kafka-durable", port=free_port(), s3_endpoint=s3_endpoint)
    broker.start()
    try:
        broker.wait_ready()
        web, plan = fault_web(f"brk{unique[:6]}s", tmp_path)
        with crawl(web, plan, {**crawl_env, "KAFKA_HOSTS": hosts}, tmp_path, WORKERS) as (cluster, outcomes):
            assert outcomes.wait(TIMEOUT, fail_if_dead(cluster), until=len(plan) // 3), \
                outcome_report(outcomes, plan)
            broker.stop()
            time.sleep(BROKER_DOWN)
            broker.start()
            broker.wait_ready()
            assert outcomes.wait(TIMEOUT, fail_if_dead(cluster)), outcome_report(outcomes, plan)
            assert not cluster.died(), [c.name for c in cluster.died()]
    finally:
        broker.stop()
    print(f"\n[broker] duplicates after the restart: {outcomes.duplicates()}")
    assert_outcomes(outcomes, plan)
    assert_polite(web, WORKERS)


def test_s3_outage_mid_crawl_thumbnails_wait(crawl_env, tmp_path: Path, unique: str) -> None:
    """S3 down for 10 s: thumbnails wait (infra_retry), no URL ends in error for it, and
    every success has its thumbnail in the bucket afterwards."""
    store, endpoint = s3_server(tmp_path / "s3", port=free_port(), bucket=BUCKET)
    store.start()
    try:
        store.wait_ready()
        web, plan = fault_web(f"s3o{unique[:6]}s", tmp_path)
        with crawl(web, plan, {**crawl_env, "S3_ENDPOINT_URL": endpoint}, tmp_path, WORKERS) as (cluster, outcomes):
            assert outcomes.wait(TIMEOUT, fail_if_dead(cluster), until=len(plan) // 3), \
                outcome_report(outcomes, plan)
            store.stop()
            time.sleep(S3_DOWN)
            store.start()
            store.wait_ready()
            assert outcomes.wait(TIMEOUT, fail_if_dead(cluster)), outcome_report(outcomes, plan)
            assert not cluster.died(), [c.name for c in cluster.died()]
        assert_outcomes(outcomes, plan)
        successes = {u for u, kinds in outcomes.kinds.items() if QUALITY in kinds}
        stored = thumbnail_keys(endpoint)
        missing = {f"{u}.jpg" for u in successes} - stored
        assert successes and not missing, f"{len(missing)} of {len(successes)} successes have no thumbnail"
    finally:
        store.stop()
    assert_polite(web, WORKERS)


def thumbnail_keys(endpoint: str) -> set[str]:
    import botocore.session
    client = botocore.session.get_session().create_client("s3", endpoint_url=endpoint, **DEV_CREDENTIALS)
    keys: set[str] = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        keys |= {item["Key"] for item in page.get("Contents", [])}
    return keys


RESTART_ROUNDS = 2  # each round ~25-35 s; 5, then 3, put the suite over its 15 minutes
RESTART_REQUEST_WITHIN = 15.0  # seconds from a lone worker's start to its first request
RESTART_WORKERS = 3


def first_request_after(web: SimWeb, since: float, within: float, outcomes) -> float | None:
    """Seconds from ``since`` to the first request any site saw after it; None past ``within``."""
    deadline = since + within
    while time.time() < deadline:
        outcomes.poll(0.2)
        later = [r.time for r in web.all_requests() if r.time > since]
        if later:
            return min(later) - since
    return None


def test_all_workers_stopped_together_then_one_started(crawl_env, tmp_path: Path, unique: str) -> None:
    """A deploy or a Ctrl-C stops every worker at once (SIGTERM); the next worker must crawl.

    On tansu a LeaveGroup from the group's leader while the group re-forms strands every
    later member, so the local stack's workers leave no group (KAFKA_LEAVE_GROUP=false)."""
    web, plan = fault_web(f"rst{unique[:6]}s", tmp_path)
    waits = []
    with crawl(web, plan, crawl_env, tmp_path, RESTART_WORKERS) as (cluster, outcomes):
        for _round in range(RESTART_ROUNDS):
            assert outcomes.wait(TIMEOUT, fail_if_dead(cluster), until=len(outcomes.kinds) + 30), \
                outcome_report(outcomes, plan)
            workers = [c for c in cluster.children if c.name.startswith("worker") and c.alive()]
            codes = cluster.stop_children(workers)
            assert all(code == 0 for code in codes.values()), f"a worker did not stop cleanly: {codes}"
            started = time.time()
            cluster.start_worker()
            waits.append(first_request_after(web, started, RESTART_REQUEST_WITHIN, outcomes))
            assert waits[-1] is not None, \
                f"round {len(waits)}: the restarted worker made no request in {RESTART_REQUEST_WITHIN} s " \
                f"(waits so far {waits}); see {tmp_path}"
        outcomes.wait(TIMEOUT, fail_if_dead(cluster))
    asked = Counter((r.site, r.path) for r in fetches(web.all_requests()))
    repeats = sum(n - 1 for n in asked.values())
    print(f"\n[restart] seconds from a lone worker's start to its first request: "
          f"{[round(w, 1) for w in waits]}; duplicates {outcomes.duplicates()}; repeated requests {repeats}")
    assert_outcomes(outcomes, plan)
    assert_polite(web, RESTART_WORKERS)
    # A clean stop parks what it had not started and commits past it: when it left them queued,
    # the next owner read again all that finished above them, 704 repeats for 592 URLs.
    assert repeats <= 0.05 * len(plan), f"{repeats} repeated requests for {len(plan)} URLs"


# --- Hostile input ---------------------------------------------------------------------
HOSTILE_COUNT = 1000
WORKER_HOSTILE_COUNT = 100
HOSTILE_CRAWL_TIMEOUT = 60.0  # 80 URLs at 4 x 6 req/s


def hostile_messages(count: int, seed: int = 6) -> list[bytes | None]:
    """Random bytes, huge strings, wrong types, deep nesting, bad URLs, unicode oddities:
    every one of them a message the contract says to reject."""
    rng = random.Random(seed)
    ok = {"url": "http://127.0.0.1:9/img/1.jpg", "uuid": "hostile", "source": "hostile"}

    def with_(**fields) -> bytes:
        return json.dumps({**ok, **fields}).encode()

    def without(name: str) -> bytes:
        return json.dumps({k: v for k, v in ok.items() if k != name}).encode()

    odd_values = [None, 0, -1, 1.5, True, [], {}, [ok["url"]], {"url": ok["url"]}, "", " \t\n"]
    bad_urls = ["javascript:alert(1)", "ftp://127.0.0.1/a.jpg", "file:///etc/passwd", "http://", "http:///x",
                "//127.0.0.1/a.jpg", "127.0.0.1/a.jpg", "http://[::1/a.jpg", "http://127.0.0.1:99999/a.jpg",
                "http://127.0.0.1/a b.jpg", "http://127.0.0.1/\x00.jpg", "http://127.0.0.1/\t.jpg",
                "data:image/png;base64,iVBORw0KGgo=", "http://127.0.0.1/" + "a" * 5000, "\ud800",
                "https://127.0.0.1:-1/", "http://127.0.0.1/\x7f", "gopher://127.0.0.1:70/"]
    bad_sources = ["", "has space", "../../etc", "a" * 300, "\U0001f984", "fl\u200bickr", "tab\tsource",
                   "semi;colon", "slash/source", "null\x00byte", "\u202eevil", "é"]
    structured: list[bytes | None] = [
        None, b"", b"null", b"true", b"0", b"[]", b"{}", b'"string"', b"NaN",
        b"[" * 100_000 + b"]" * 100_000,                      # deeper than any parser's stack
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        json.dumps([ok]).encode(),                            # a valid message, wrapped in a list
        b'"' + b"A" * 500_000 + b'"',                         # huge string
        with_(url="http://127.0.0.1/" + "x" * 400_000),       # huge URL
        with_(extra="y" * 300_000, url="nope"),
        b'{"url": NaN, "uuid": Infinity, "source": -Infinity}',
        b'{"url": "http://127.0.0.1/a.jpg", "url": 5, "uuid": "u", "source": "s"}',  # last key wins
        b"\xff\xfe{\x00}\x00", b"\xc0\xaf", b"\xed\xa0\x80", b"{\"url\": \"\xff\"}",
        b"\xef\xbb\xbf" + with_(source="has space"),          # BOM before an invalid message
        json.dumps({"url": {"url": {"url": ok}}, "uuid": ok, "source": [ok]}).encode(),
        with_(attempts=-1), with_(attempts="1"), with_(attempts=1.5), with_(attempts=True),
        without("url"), without("uuid"), without("source"),
    ]
    structured += [with_(url=u) for u in bad_urls] + [with_(source=s) for s in bad_sources]
    structured += [with_(**{name: v}) for name in ("url", "uuid", "source") for v in odd_values
                   if not (name == "source" and isinstance(v, str) and v.strip())]
    messages: list[bytes | None] = list(structured)
    while len(messages) < count:
        roll = rng.random()
        if roll < 0.45:
            messages.append(rng.randbytes(rng.randint(1, 3000)))
        elif roll < 0.7:
            messages.append(rng.choice(structured))
        elif roll < 0.85:
            alphabet = string.printable + "\u202e\u200b\ufeff\U0001f4a9"
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 200)))
            messages.append(with_(**{rng.choice(["url", "source"]): text}) if rng.random() < 0.5
                            else text.encode("utf-8", "surrogatepass"))
        else:
            messages.append(with_(uuid=rng.choice(odd_values)))
    return messages[:count]


def _invalid(raw: bytes | None) -> bool:
    try:
        parse_crawl_request(raw)
    except Exception:  # noqa: BLE001 - any failure to parse counts; that it is an InvalidMessage is the splitter's job
        return True
    return False


def as_rejected_raw(raw: bytes | None) -> str:
    return (raw or b"")[:MAX_REJECTED_RAW_BYTES].decode("utf-8", errors="replace")


def test_hostile_messages_are_rejected_and_nothing_dies(crawl_env, tmp_path: Path, unique: str) -> None:
    """1,000 into inbound_images (the splitter's input) and 100 straight into urls (the
    workers' input, as a buggy producer would): each one a rejected_messages record."""
    messages = hostile_messages(HOSTILE_COUNT)
    assert all(_invalid(m) for m in messages), "the generator made a valid message"
    web, plan = fault_web(f"host{unique[:6]}s", tmp_path, urls_per_source=20)
    first, second = plan[: len(plan) // 2], plan[len(plan) // 2:]
    worker_topic = URLS_TOPIC
    sent = [(INBOUND_TOPIC, m) for m in messages] + [(worker_topic, m) for m in messages[:WORKER_HOSTILE_COUNT]]
    wanted = Counter((topic, as_rejected_raw(m)) for topic, m in sent)
    started_ms = int(time.time() * 1000)
    with crawl(web, first, crawl_env, tmp_path, WORKERS) as (cluster, outcomes):
        producer = Producer(producer_config(crawl_env["KAFKA_HOSTS"], **{"message.max.bytes": 2_000_000}))
        for topic, raw in sent:
            producer.produce(topic, value=raw)
        assert producer.flush(60) == 0
        # Valid URLs after the flood still get their outcomes.
        outcomes.wanted |= {p.uuid for p in second}
        cluster.schedule(write_tsv(web, second, tmp_path / "after.tsv"))
        missing = wanted - collect_rejected(crawl_env["KAFKA_HOSTS"], wanted, started_ms)
        assert not missing, f"{sum(missing.values())} hostile messages not in {REJECTED_TOPIC} (see the logs " \
                            f"in {tmp_path}), e.g. {[(t, raw[:80]) for t, raw in list(missing)[:5]]}"
        assert outcomes.wait(HOSTILE_CRAWL_TIMEOUT, fail_if_dead(cluster)), outcome_report(outcomes, plan)
        assert not cluster.died(), [c.name for c in cluster.died()]
    assert_outcomes(outcomes, plan)


def collect_rejected(kafka_hosts: str, wanted: Counter, since_ms: int, timeout: float = 60.0) -> Counter:
    """(topic, raw) of every rejected_messages record since ``since_ms``, until ``wanted`` is seen."""
    consumer = Consumer(consumer_config(kafka_hosts, f"rejected-{random.getrandbits(64):x}"))
    consumer.subscribe([REJECTED_TOPIC])
    got: Counter = Counter()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and wanted - got:
            for msg in consumer.consume(1000, 0.5):
                if msg.error() or msg.timestamp()[1] < since_ms:
                    continue
                record = json.loads(msg.value())
                assert set(record) >= {"topic", "raw", "error", "time"}, record
                assert isinstance(record["error"], str) and record["error"], record
                got[(record["topic"], record["raw"])] += 1
    finally:
        consumer.close()
    return got
