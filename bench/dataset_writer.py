"""The dataset collector's cost per image, beside img2dataset's own shard writer on the same images.

``flock /tmp/bench.lock .venv/bin/python -m bench.dataset_writer [--images 4000] [--per-shard 1000]
[--format webdataset] [--peer-python bench/.venv-img2dataset/bin/python]``

Starts tansu and SeaweedFS (devstack), stores ``--images`` thumbnails (640 x 480 JPEGs) in S3
and their outcome messages (a quality message each, an EXIF message for a third) in Kafka,
untimed; then times the collector (``url_lists.dataset``) turning them into webdataset shards:
its process's CPU, the servers' CPU over the same span (the S3 GETs and the Kafka reads it
causes), wall time. Then img2dataset's ``WebDatasetSampleWriter`` (its venv, ``make
peer-venv``) writes the same images with the same metadata: the part of img2dataset's own
CPU per image that the collector stands for (img2dataset holds each image in memory; the
crawler's are in S3). Prints both, and the ratio.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import resource
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pyarrow as pa
from confluent_kafka import Producer
from PIL import Image, ImageFilter

from bench.cpu import proc_cpu
from common import contracts
from common.kafka import ensure_topics, producer_config
from common.settings import Settings
from devstack.servers import DEV_CREDENTIALS, kafka_server, s3_server
from url_lists.dataset.collector import Collector, DatasetOptions
from url_lists.dataset.inputs import write_input_shard
from url_lists.dataset.keys import new_run_id, row_identifier, sample_key
from url_lists.dataset.outcomes import OUTCOME_TOPICS
from worker.imaging.thumbnails import s3_thumbnails

BUCKET = "cc-image-analysis"
PEER_PYTHON = Path(__file__).resolve().parent / ".venv-img2dataset" / "bin" / "python"
DISTINCT_IMAGES = 16


def thumbnails(count: int) -> list[bytes]:
    """640 x 480 JPEGs at the crawler's quality, with texture so they are photo-sized (~40 KB)."""
    rng = random.Random(7)
    images = []
    for n in range(count):
        base = Image.radial_gradient("L").resize((640, 480)).convert("RGB")
        noise = Image.effect_noise((640, 480), 40 + n).convert("RGB").filter(ImageFilter.GaussianBlur(1.2))
        image = Image.blend(base, noise, 0.35 + rng.random() * 0.2)
        out = io.BytesIO()
        image.save(out, "JPEG", quality=85)
        images.append(out.getvalue())
    return images


def rusage_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def unique(images: list[bytes], row: int) -> bytes:
    """Image ``row``: one of the distinct ones with the row in a JPEG comment after its SOI
    marker, so that no two are equal (as in a crawl; a Parquet dictionary would fold repeats)."""
    base = images[row % len(images)]
    comment = str(row).encode()
    return base[:2] + b"\xff\xfe" + (len(comment) + 2).to_bytes(2, "big") + comment + base[2:]


async def store(settings: Settings, run, images: list[bytes], count: int) -> None:
    async with s3_thumbnails(settings) as store:
        semaphore = asyncio.Semaphore(32)

        async def put(row: int) -> None:
            async with semaphore:
                await store.put(row_identifier(run, row), unique(images, row))
        await asyncio.gather(*(put(row) for row in range(count)))


def produce(hosts: str, run, count: int, sizes: list[int]) -> None:
    producer = Producer(producer_config(hosts))
    for row in range(count):
        identifier = row_identifier(run, row)
        if row % 3 == 0:
            producer.produce(contracts.METADATA_TOPIC, json.dumps(
                {"identifier": identifier, "exif": {"0x10f": "Canon", "0x110": "EOS 5D", "0x9209": 0}}).encode(),
                key=identifier)
        producer.produce(contracts.METADATA_TOPIC, json.dumps(
            {"identifier": identifier, "width": 1024, "height": 768, "compression_quality": 88,
             "filesize": sizes[row % len(sizes)] * 3, "x_robots_tag": []}).encode(), key=identifier)
        producer.poll(0)
    assert producer.flush(60) == 0


def input_shards(folder: Path, count: int, per_shard: int) -> list[int]:
    shards = []
    for shard, start in enumerate(range(0, count, per_shard)):
        rows = range(start, min(count, start + per_shard))
        write_input_shard(folder, shard, pa.table({
            "row": pa.array(list(rows), pa.int64()), "key": [sample_key(r, per_shard) for r in rows],
            "url": [f"http://site{r % 50}.example/images/{r}.jpg" for r in rows],
            "caption": [f"a photograph, number {r}, of something" for r in rows],
            "status": ["accepted"] * len(rows), "bad_reason": [None] * len(rows),
            "source_file": ["list.parquet"] * len(rows), "source_row": pa.array([r + 1 for r in rows], pa.int64()),
            "license": ["cc-by"] * len(rows)}))
        shards.append(shard)
    return shards


PEER_SCRIPT = textwrap.dedent("""
    import json, resource, sys, time
    import pyarrow as pa
    from img2dataset.writer import WebDatasetSampleWriter
    folder, count, per_shard, images_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    images = [open(f"{images_dir}/{n}.jpg", "rb").read() for n in range(int(sys.argv[5]))]
    def unique(row):
        base, comment = images[row % len(images)], str(row).encode()
        return base[:2] + b"\\xff\\xfe" + (len(comment) + 2).to_bytes(2, "big") + comment + base[2:]
    schema = pa.schema([("url", pa.string()), ("caption", pa.string()), ("license", pa.string()),
                        ("key", pa.string()), ("status", pa.string()), ("error_message", pa.string()),
                        ("width", pa.int32()), ("height", pa.int32()), ("original_width", pa.int32()),
                        ("original_height", pa.int32()), ("exif", pa.string())])
    def cpu():
        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime
    start_cpu, start = cpu(), time.monotonic()
    for shard, first in enumerate(range(0, count, per_shard)):
        writer = WebDatasetSampleWriter(shard, folder, True, 5, schema, "jpg")
        for row in range(first, min(count, first + per_shard)):
            key = f"{shard:05d}{row - first:04d}"
            caption = f"a photograph, number {row}, of something"
            meta = {"url": f"http://site{row % 50}.example/images/{row}.jpg", "caption": caption,
                    "license": "cc-by", "key": key, "status": "success", "error_message": None,
                    "width": 640, "height": 480, "original_width": 1024, "original_height": 768,
                    "exif": json.dumps({"Image Make": "Canon"}) if row % 3 == 0 else None}
            writer.write(unique(row), key, caption, meta)
        writer.close()
    print(json.dumps({"cpu": cpu() - start_cpu, "wall": time.monotonic() - start}))
""")


def run_peer(python: Path, work: Path, images: list[bytes], count: int, per_shard: int) -> dict[str, float] | None:
    if not python.exists():
        return None
    images_dir = work / "peer-images"
    images_dir.mkdir()
    for n, image in enumerate(images):
        (images_dir / f"{n}.jpg").write_bytes(image)
    out = work / "peer-out"
    out.mkdir()
    result = subprocess.run([str(python), "-c", PEER_SCRIPT, str(out), str(count), str(per_shard),
                             str(images_dir), str(len(images))], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--per-shard", type=int, default=1000)
    parser.add_argument("--format", default="webdataset", choices=("webdataset", "parquet", "files"))
    parser.add_argument("--profile", action="store_true", help="cProfile the collector's event loop thread")
    parser.add_argument("--peer-python", type=Path, default=PEER_PYTHON, help="img2dataset's venv's python")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-dataset-") as temporary:
        work = Path(temporary)
        kafka, hosts = kafka_server(work / "kafka")
        s3, endpoint = s3_server(work / "s3", bucket=BUCKET)
        try:
            for server in (kafka, s3):
                server.start()
            for server in (kafka, s3):
                server.wait_ready()
            settings = Settings(kafka_hosts=hosts, s3_endpoint_url=endpoint, s3_bucket=BUCKET,
                                redis_url="redis://127.0.0.1:1/0",
                                aws_access_key_id=DEV_CREDENTIALS["aws_access_key_id"],
                                aws_secret_access_key=DEV_CREDENTIALS["aws_secret_access_key"])
            ensure_topics(hosts, OUTCOME_TOPICS, contracts.INBOUND_PARTITIONS)
            images = thumbnails(DISTINCT_IMAGES)
            run = new_run_id()
            folder = work / "out"
            shards = input_shards(folder, args.images, args.per_shard)
            (folder / "_crawl" / "run.json").write_text(json.dumps({"run": str(run)}))
            asyncio.run(store(settings, run, images, args.images))
            produce(hosts, run, args.images, [len(i) for i in images])
            collector = Collector(DatasetOptions(folder=folder, output_format=args.format, per_shard=args.per_shard,
                                                 image_size=640, run=run), settings)
            for shard in shards:
                collector.expect(shard)
            collector.no_more_shards()
            servers = [p.pid for p in (kafka.process, s3.process) if p is not None]
            cpu0, servers0, wall0 = rusage_cpu(), proc_cpu(servers), time.monotonic()
            if args.profile:
                import cProfile
                import pstats
                profiler = cProfile.Profile()
                profiler.runcall(collector.run, threading.Event())
            else:
                collector.run(threading.Event())
            cpu1, servers1, wall1 = rusage_cpu(), proc_cpu(servers), time.monotonic()
            written = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
            peer = run_peer(args.peer_python, work, images, args.images, args.per_shard)
        finally:
            for server in (kafka, s3):
                server.stop()
    n = args.images
    if args.profile:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    ours_ms, servers_ms = 1000 * (cpu1 - cpu0) / n, 1000 * (servers1 - servers0) / n
    print(f"images: {n:,} ({sum(len(i) for i in images) // len(images):,} bytes on average), "
          f"{args.format}, {args.per_shard:,} a shard; {written / 1e6:,.1f} MB written")
    print(f"collector: {n / (wall1 - wall0):,.0f} images/s; CPU {ours_ms:.3f} ms an image in its process "
          f"+ {servers_ms:.3f} ms in tansu and SeaweedFS = {ours_ms + servers_ms:.3f} ms")
    if peer is not None:
        peer_ms = 1000 * peer["cpu"] / n
        print(f"img2dataset's WebDatasetSampleWriter, same images and metadata: {n / peer['wall']:,.0f} images/s; "
              f"CPU {peer_ms:.3f} ms an image")
        print(f"ratio (collector with servers / img2dataset's writer): {(ours_ms + servers_ms) / peer_ms:.2f}; "
              f"collector alone: {ours_ms / peer_ms:.2f}")
    else:
        print(f"img2dataset's venv is missing ({args.peer_python}): no side-by-side number", file=sys.stderr)


if __name__ == "__main__":
    main()
