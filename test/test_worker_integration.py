"""``python -m worker`` on the real servers, with a local website on 127.0.0.1.

The test plays the monitor's part itself (sources, rates, token refills),
produces straight to ``urls`` and judges the worker by its outputs:
Kafka topics, S3 objects and Redis counters.
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from collections.abc import Callable

import pytest
from aiobotocore.session import get_session
from aiohttp import web
from aiohttp.test_utils import TestServer
from PIL import Image

from common.contracts import (CRAWL_ERRORS_TOPIC, INBOUND_SOURCES, INBOUND_TOPIC, LINK_ROT_TOPIC,
                              METADATA_TOPIC, errors_key, last_50_key, rate_limit_key, resized_key,
                              source_requests_key, tokens_key, URLS_TOPIC)
from common.kafka import AsyncConsumer, AsyncProducer, consumer_config, ensure_topics, producer_config
from worker.constants import STOP_MARGIN_SECONDS
from devstack.servers import DEV_CREDENTIALS, DEV_URL_PARTITIONS
from test.conftest import BUCKET
from test.worker_fakes import exif_jpeg, image_bytes

ROOT = Path(__file__).resolve().parent.parent
OUTCOME_TOPICS = [METADATA_TOPIC, LINK_ROT_TOPIC, CRAWL_ERRORS_TOPIC, INBOUND_TOPIC]
PHOTO = exif_jpeg()
BIG = image_bytes("JPEG", (1600, 1200), quality=90)
WORKER_SHUTDOWN_TIMEOUT = 20


def website() -> web.Application:
    async def photo(request: web.Request) -> web.Response:
        delay = float(request.query.get("delay", 0))
        await asyncio.sleep(delay)
        return web.Response(body=BIG if "big" in request.query else PHOTO, content_type="image/jpeg")

    async def status(request: web.Request) -> web.Response:
        return web.Response(status=int(request.match_info["code"]), text="<html>nope</html>",
                            content_type="text/html")

    app = web.Application()
    app.router.add_get("/photo/{name}", photo)
    app.router.add_get("/status/{code}/{name}", status)
    return app


@pytest.fixture
async def site():
    server = TestServer(website(), host="127.0.0.1")
    await server.start_server()
    yield server
    await server.close()


class Worker:
    """A ``python -m worker`` subprocess in its own process group, logging to a file."""

    def __init__(self, env: dict[str, str], log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.process = subprocess.Popen([sys.executable, "-m", "worker"], cwd=ROOT, env=env,
                                        stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def kill_group(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self._log.close()


@pytest.fixture
def workers(stack_env, tmp_path):
    started: list[Worker] = []

    def start(**env: str) -> Worker:
        worker = Worker({**stack_env, "SHUTDOWN_TIMEOUT": str(WORKER_SHUTDOWN_TIMEOUT), **env},
                        tmp_path / f"worker{len(started)}.log")
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill_group()


@asynccontextmanager
async def monitor_stand_in(redis_client, source: str, rate: int):
    """What the monitor would do for ``source``: list it, publish its rate, refill its bucket each second."""
    await redis_client.sadd(INBOUND_SOURCES, source)
    await redis_client.set(rate_limit_key(source), rate)

    async def refill() -> None:
        while True:
            await redis_client.set(tokens_key(source), rate)
            await asyncio.sleep(1)

    refiller = asyncio.create_task(refill())
    try:
        yield
    finally:
        refiller.cancel()


def ensure_crawl_topics(kafka_hosts: str) -> None:
    """The topics a worker reads and writes, as the monitor and the workers create them."""
    ensure_topics(kafka_hosts, OUTCOME_TOPICS, 4)
    ensure_topics(kafka_hosts, [URLS_TOPIC], DEV_URL_PARTITIONS)


async def produce(kafka_hosts: str, source: str, messages: list[dict]) -> None:
    producer = AsyncProducer(producer_config(kafka_hosts))
    try:
        await asyncio.gather(*(producer.send(URLS_TOPIC, json.dumps(m).encode(), source) for m in messages))
    finally:
        await producer.close()


class Outcomes:
    """Every message on the outcome topics about our uuids, read by a private consumer group."""

    def __init__(self, kafka_hosts: str, group: str, uuids: set[str]):
        self.uuids = uuids
        self.by_topic: dict[str, list[dict]] = {topic: [] for topic in OUTCOME_TOPICS}
        self._consumer = AsyncConsumer(consumer_config(kafka_hosts, group))

    async def start(self) -> None:
        await self._consumer.subscribe(OUTCOME_TOPICS)

    async def wait_for(self, done: Callable[[Outcomes], bool], timeout: float, worker: Worker) -> None:
        deadline = time.monotonic() + timeout
        while not done(self):
            assert time.monotonic() < deadline, f"timed out; worker log:\n{worker.log()}"
            assert worker.process.poll() is None, f"worker exited; log:\n{worker.log()}"
            for message in await self._consumer.consume(500, 0.5):
                if message.error():
                    continue
                value = json.loads(message.value())
                if (value.get("identifier") or value.get("uuid")) in self.uuids:
                    self.by_topic[message.topic()].append(value)

    def terminal(self) -> dict[str, str]:
        """uuid -> the topic of its (last) terminal outcome."""
        out = {}
        for topic in (METADATA_TOPIC, LINK_ROT_TOPIC, CRAWL_ERRORS_TOPIC):
            for value in self.by_topic[topic]:
                if topic != METADATA_TOPIC or "width" in value:
                    out[value["identifier"]] = topic
        return out

    async def close(self) -> None:
        await self._consumer.close()


async def s3_thumbnail(s3_endpoint: str, uuid: str) -> Image.Image:
    async with get_session().create_client("s3", endpoint_url=s3_endpoint, **DEV_CREDENTIALS) as s3:
        response = await s3.get_object(Bucket=BUCKET, Key=f"{uuid}.jpg")
        body = await response["Body"].read()
    image = Image.open(io.BytesIO(body))
    image.load()
    return image


async def until_group_gone(pgid: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"processes of group {pgid} outlived their worker")


async def stop_cleanly(worker: Worker) -> None:
    worker.process.send_signal(signal.SIGTERM)
    # Past its bound (3 x SHUTDOWN_TIMEOUT + STOP_MARGIN_SECONDS) a worker exits 1 by itself,
    # with every thread's stack in its log: what held it.
    code = await asyncio.to_thread(worker.process.wait, 3 * WORKER_SHUTDOWN_TIMEOUT + STOP_MARGIN_SECONDS + 15)
    assert code == 0, worker.log(20_000)
    await until_group_gone(worker.process.pid)


async def test_worker_publishes_every_outcome_stores_thumbnails_and_counts(
        site, workers, redis_client, kafka_hosts, s3_endpoint, unique) -> None:
    source = f"wint{unique}"
    base = str(site.make_url(""))
    plan = {
        f"ok-{unique}-{i}": f"{base}/photo/{i}.jpg" for i in range(3)
    } | {
        f"big-{unique}": f"{base}/photo/big.jpg?big=1",
        f"rot-{unique}": f"{base}/status/404/x.jpg",
        f"retry-{unique}": f"{base}/status/503/x.jpg",
        f"html-{unique}": f"{base}/status/200/x.jpg",
        f"denied-{unique}": f"{base}/status/403/x.jpg",
    }
    messages = [{"url": url, "uuid": uuid, "source": source} for uuid, url in plan.items()]
    messages.append({"url": f"{base}/status/500/y.jpg", "uuid": f"spent-{unique}", "source": source, "attempts": 1})
    ensure_crawl_topics(kafka_hosts)
    outcomes = Outcomes(kafka_hosts, f"test-{unique}", {m["uuid"] for m in messages})
    await outcomes.start()
    async with monitor_stand_in(redis_client, source, rate=20):
        await produce(kafka_hosts, source, messages)
        worker = workers(MAX_TASKS="20")
        await outcomes.wait_for(lambda o: len(o.terminal()) == len(messages) - 1 and o.by_topic[INBOUND_TOPIC],
                                timeout=90, worker=worker)
        await stop_cleanly(worker)
    await outcomes.close()

    terminal = outcomes.terminal()
    assert {u: terminal[u] for u in plan if u.startswith(("ok", "big"))} == {
        u: METADATA_TOPIC for u in plan if u.startswith(("ok", "big"))}
    assert terminal[f"rot-{unique}"] == LINK_ROT_TOPIC
    errors = {e["identifier"]: e for e in outcomes.by_topic[CRAWL_ERRORS_TOPIC]}
    assert (errors[f"html-{unique}"]["reason"], errors[f"html-{unique}"]["status"]) == ("UnidentifiedImageError", 200)
    assert errors[f"denied-{unique}"]["status"] == 403
    assert (errors[f"spent-{unique}"]["status"], errors[f"spent-{unique}"]["attempts"]) == (500, 1)
    (retry,) = outcomes.by_topic[INBOUND_TOPIC]
    assert (retry["uuid"], retry["attempts"]) == (f"retry-{unique}", 1)

    quality = {m["identifier"]: m for m in outcomes.by_topic[METADATA_TOPIC] if "width" in m}
    assert (quality[f"big-{unique}"]["width"], quality[f"big-{unique}"]["height"]) == (1600, 1200)
    assert quality[f"big-{unique}"]["compression_quality"] == 90
    assert quality[f"big-{unique}"]["filesize"] == len(BIG)
    exif = [m for m in outcomes.by_topic[METADATA_TOPIC] if "exif" in m]
    assert {m["identifier"] for m in exif} == {f"ok-{unique}-{i}" for i in range(3)}
    assert exif[0]["exif"]["0x13b"] == "Alden Page"

    thumbnail = await s3_thumbnail(s3_endpoint, f"big-{unique}")
    assert thumbnail.format == "JPEG" and thumbnail.size == (640, 480)

    assert int(await redis_client.get(resized_key(source))) == 4
    assert int(await redis_client.get(errors_key(source, "404"))) == 1
    assert int(await redis_client.get(errors_key(source, "503"))) == 1
    assert int(await redis_client.get(source_requests_key(source))) == len(messages)
    statuses = await redis_client.lrange(last_50_key(source), 0, -1)
    assert sorted(statuses) == sorted(["200"] * 4 + ["404", "503", "UnidentifiedImageError", "403", "500"])
    # The breaker's minute counts one error a URL: the spent URL's 500, a retry's failure, is not in it.
    assert await redis_client.zcard(f"status60s:{source}") == len(messages) - 1


async def test_sigkill_mid_batch_loses_no_url(site, workers, redis_client, kafka_hosts, unique) -> None:
    source = f"wkill{unique}"
    base = str(site.make_url(""))
    messages = [{"url": f"{base}/photo/{i}.jpg?delay=0.3", "uuid": f"kill-{unique}-{i}", "source": source}
                for i in range(60)]
    ensure_crawl_topics(kafka_hosts)
    outcomes = Outcomes(kafka_hosts, f"test-{unique}", {m["uuid"] for m in messages})
    await outcomes.start()
    async with monitor_stand_in(redis_client, source, rate=8):
        await produce(kafka_hosts, source, messages)
        first = workers(MAX_TASKS="10")
        await outcomes.wait_for(lambda o: len(o.terminal()) >= 12, timeout=90, worker=first)
        first.process.kill()  # SIGKILL: no drain, no commit
        first.process.wait()
        await until_group_gone(first.process.pid)  # its image pool dies with it
        second = workers(MAX_TASKS="10")
        await outcomes.wait_for(lambda o: len(o.terminal()) == len(messages), timeout=120, worker=second)
        await stop_cleanly(second)
    await outcomes.close()
    assert set(outcomes.terminal().values()) == {METADATA_TOPIC}
