"""The collector against the real Kafka, S3 and Redis (session fixtures): outcome messages and
thumbnails in, dataset shards and stats out; and a SIGKILLed collector's rerun."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from datetime import datetime
from pathlib import Path

import botocore.auth
import pyarrow.parquet as pq
import pytest
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from confluent_kafka import Producer

from common import contracts
from common.kafka import ensure_topics, producer_config
from common.settings import Settings
from devstack.servers import DEV_CREDENTIALS
from test.conftest import BUCKET
from test.dataset_fakes import jpeg, write_list
from url_lists.dataset.collector import Collector, DatasetOptions
from url_lists.dataset.inputs import read_input_shard
from url_lists.dataset.keys import new_run_id, row_identifier
from url_lists.dataset.outcomes import OUTCOME_TOPICS
from url_lists.dataset.s3 import GetSigner, s3_thumbnail_reader
from worker.constants import S3_PRESIGN_SECONDS
from worker.imaging.thumbnails import put_signer, s3_thumbnails

PER_SHARD = 5
ROOT = Path(__file__).resolve().parent.parent


def settings_for(kafka_hosts: str, s3_endpoint: str, redis_url: str = "redis://localhost:1/0") -> Settings:
    return Settings(kafka_hosts=kafka_hosts, s3_endpoint_url=s3_endpoint, s3_bucket=BUCKET, redis_url=redis_url,
                    aws_access_key_id=DEV_CREDENTIALS["aws_access_key_id"],
                    aws_secret_access_key=DEV_CREDENTIALS["aws_secret_access_key"])


def outcome_messages(run, rows: range) -> list[tuple[str, dict]]:
    """Row r: r % 4 == 1 link rot, r % 4 == 2 an HTTP 403, else a success (EXIF where r % 3 == 0)."""
    out: list[tuple[str, dict]] = []
    for row in rows:
        identifier = row_identifier(run, row)
        if row % 4 == 1:
            out.append((contracts.LINK_ROT_TOPIC, {"identifier": identifier, "time": "2026-01-01T00:00:00"}))
        elif row % 4 == 2:
            out.append((contracts.CRAWL_ERRORS_TOPIC, {
                "identifier": identifier, "url": f"http://site{row % 3}.test/{row}.jpg", "source": "x",
                "reason": "HTTP 403", "status": 403, "attempts": 0, "time": "2026-01-01T00:00:00"}))
        else:
            if row % 3 == 0:
                out.append((contracts.METADATA_TOPIC, {"identifier": identifier, "exif": {"0x10f": f"cam{row}"}}))
            out.append((contracts.METADATA_TOPIC, {"identifier": identifier, "width": 800, "height": 600,
                                                   "compression_quality": 88, "filesize": 5000 + row,
                                                   "x_robots_tag": []}))
    return out


def produce(kafka_hosts: str, messages: list[tuple[str, dict]]) -> None:
    producer = Producer(producer_config(kafka_hosts))
    for topic, message in messages:
        producer.produce(topic, json.dumps(message).encode(), key=message["identifier"])
    assert producer.flush(30) == 0


async def store_thumbnails(settings: Settings, run, rows: range) -> dict[int, bytes]:
    images = {row: jpeg(40 + row, 30, (row * 7 % 255, 20, 20)) for row in rows if row % 4 in (0, 3)}
    async with s3_thumbnails(settings) as thumbnails:
        for row, image in images.items():
            await thumbnails.put(row_identifier(run, row), image)
    return images


def check(folder: Path, shards: int, rows: int, images: dict[int, bytes]) -> None:
    seen = []
    for shard in range(shards):
        table = pq.read_table(folder / f"{shard:05d}.parquet").to_pylist()
        assert sorted(r["key"] for r in table) == sorted(read_input_shard(folder, shard).column("key").to_pylist())
        seen += [r["key"] for r in table]
        with tarfile.open(folder / f"{shard:05d}.tar") as tar:
            members = {name: tar.extractfile(name).read() for name in tar.getnames()}  # type: ignore[union-attr]
        for row in table:
            number = shard * PER_SHARD + int(row["key"][5:])
            expected = "link_rot" if number % 4 == 1 else "error" if number % 4 == 2 else "success"
            assert row["status"] == expected
            if expected == "success":
                assert members[f"{row['key']}.jpg"] == images[number]
                assert members[f"{row['key']}.txt"] == f"caption {number}".encode()
                assert row["filesize"] == 5000 + number
                assert (row["exif"] is not None) == (number % 3 == 0)
        assert len(members) == 3 * sum(1 for r in table if r["status"] == "success")
    assert len(seen) == len(set(seen)) == rows
    totals = json.loads((folder / "stats.json").read_text())["totals"]
    assert totals["rows"] == rows
    assert totals["successes"] == len(images)


@pytest.fixture
def topics(kafka_hosts: str) -> None:
    ensure_topics(kafka_hosts, OUTCOME_TOPICS, contracts.INBOUND_PARTITIONS)


async def test_outcomes_on_kafka_and_thumbnails_in_s3_become_shards(tmp_path: Path, kafka_hosts: str,
                                                                    s3_endpoint: str, redis_url: str,
                                                                    redis_client, topics: None) -> None:
    run = new_run_id()
    settings = settings_for(kafka_hosts, s3_endpoint, redis_url)
    rows = 13
    shards = write_list(tmp_path, rows, PER_SHARD)
    (tmp_path / "_crawl" / "run.json").write_text(json.dumps({"run": str(run)}))
    images = await store_thumbnails(settings, run, range(rows))
    await redis_client.zadd(contracts.ACTIVE_SOURCES, {"site0.test": time.time(), "site1.test": time.time()})
    await redis_client.hset(contracts.adaptive_key("site0.test"), contracts.ADAPTIVE_CEILING_FIELD, "5")
    await redis_client.hset(contracts.adaptive_key("site1.test"), contracts.ADAPTIVE_CEILING_FIELD, "2.5")
    messages = outcome_messages(run, range(rows))
    produce(kafka_hosts, messages[len(messages) // 2:] + messages)  # out of order, and each twice
    produce(kafka_hosts, outcome_messages(new_run_id(), range(rows)))  # another crawl's

    collector = Collector(DatasetOptions(folder=tmp_path, output_format="webdataset", per_shard=PER_SHARD,
                                         image_size=640, run=run), settings)
    for shard in shards:
        collector.expect(shard)
    collector.no_more_shards()
    stop = threading.Event()
    thread = threading.Thread(target=collector.run, args=(stop,))
    thread.start()
    thread.join(60)
    if thread.is_alive():
        stop.set()
        thread.join()
        pytest.fail(f"the collector did not finish: {collector.progress()}")
    check(tmp_path, len(shards), rows, images)
    summary = collector.summary()
    assert summary["totals"]["by_http_status"] == {"403": 3}
    if summary["rate"]["sites_limit_sum"] is not None:  # read while the crawl ran (it may be shorter than a look)
        assert summary["rate"]["sites_limit_sum"] == 7.5


async def test_a_rerun_after_a_sigkill_writes_every_row_once(tmp_path: Path, kafka_hosts: str, s3_endpoint: str,
                                                             topics: None) -> None:
    run = new_run_id()
    settings = settings_for(kafka_hosts, s3_endpoint)
    rows = 3 * PER_SHARD
    shards = write_list(tmp_path, rows, PER_SHARD)
    (tmp_path / "_crawl" / "run.json").write_text(json.dumps({"run": str(run)}))
    images = await store_thumbnails(settings, run, range(rows))
    produce(kafka_hosts, outcome_messages(run, range(0, PER_SHARD + 3)))  # shard 0 whole, shard 1 in part
    env = {**os.environ, "KAFKA_HOSTS": kafka_hosts, "S3_ENDPOINT_URL": s3_endpoint, "S3_BUCKET": BUCKET,
           "AWS_ACCESS_KEY_ID": DEV_CREDENTIALS["aws_access_key_id"],
           "AWS_SECRET_ACCESS_KEY": DEV_CREDENTIALS["aws_secret_access_key"], "REDIS_URL": "redis://localhost:1/0",
           "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "test.dataset_collect_process", str(tmp_path), str(run),
                                str(PER_SHARD), "webdataset"], env=env, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        journal = tmp_path / "_crawl" / "journal" / "00001.jsonl"
        deadline = time.monotonic() + 60
        while not ((tmp_path / "00000_stats.json").exists() and journal.exists() and journal.stat().st_size):
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "the collector wrote nothing"
            time.sleep(0.05)
        time.sleep(0.3)
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert not (tmp_path / "00001_stats.json").exists()
    produce(kafka_hosts, outcome_messages(run, range(PER_SHARD + 3, rows)) + outcome_messages(run, range(rows)))
    collector = Collector(DatasetOptions(folder=tmp_path, output_format="webdataset", per_shard=PER_SHARD,
                                         image_size=640, run=run), settings)
    assert set(range(PER_SHARD)) <= collector.finished_rows()
    for shard in shards:
        collector.expect(shard)
    collector.no_more_shards()
    stop = threading.Event()
    thread = threading.Thread(target=collector.run, args=(stop,))
    thread.start()
    thread.join(60)
    if thread.is_alive():
        stop.set()
        thread.join()
        pytest.fail(f"the rerun did not finish: {collector.progress()}")
    check(tmp_path, len(shards), rows, images)


FROZEN = datetime(2026, 11, 21, 12, 34, 56)


@pytest.mark.parametrize("endpoint", [None, "http://127.0.0.1:8333"], ids=["aws", "s3-compatible"])
async def test_signed_gets_are_the_clients_own_byte_for_byte(monkeypatch, endpoint: str | None) -> None:
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda *args, **kwargs: FROZEN)
    settings = Settings(s3_endpoint_url=endpoint or "", s3_bucket="thumbs", aws_default_region="eu-west-3",
                        aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key="wJalrXUtnFEMI/K7MDENG")
    signer = await put_signer(settings, GetSigner)
    async with get_session().create_client("s3", config=AioConfig(signature_version="s3v4"),
                                           **settings.s3_client_kwargs()) as client:
        key = "0b9f6a3e-4b0e-4c8e-9d5a-1f2e3d4c5b6a.jpg"
        expected = await client.generate_presigned_url("get_object", Params={"Bucket": "thumbs", "Key": key},
                                                       ExpiresIn=S3_PRESIGN_SECONDS)
        assert await signer.url(key) == expected


async def test_a_thumbnail_the_store_does_not_have_is_none(s3_endpoint: str, unique: str) -> None:
    settings = settings_for("localhost:1", s3_endpoint)
    async with s3_thumbnail_reader(settings) as reader:
        assert await reader.get(f"missing-{unique}") is None
    async with s3_thumbnails(settings) as thumbnails:
        await thumbnails.put(f"there-{unique}", b"\xff\xd8bytes\xff\xd9")
    async with s3_thumbnail_reader(settings) as reader:
        assert await reader.get(f"there-{unique}") == b"\xff\xd8bytes\xff\xd9"
