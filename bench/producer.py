"""The list producer's throughput and memory: ``python -m bench.producer [--rows 1000000] [--short 200000]``.

Starts the local stack, writes two Parquet lists (url and caption columns, the
same sites, ``--short`` and ``--rows`` rows), and produces each to
``inbound_images`` with ``python -m url_lists.list_producer`` as a user
runs it (sites derived from the URLs, sizes counted in Redis). Prints, for
each length, rows a second (from the command's start to its exit, the pool's
start and the broker's acknowledgements included) and the peak resident memory
of the producer alone and with its pool processes, and their CPU per row
(sampled from /proc every 50 ms: the CPU a row costs does not depend on how
busy the machine is, the rate does), then the ratio of the two lengths' peaks: memory must not grow with
the list. The broker's message count is checked against the rows. On this
machine the stack's servers share the 2 cores with the producer; the load
average is printed beside the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from confluent_kafka import Consumer, KafkaError, TopicPartition

from bench.cpu import _tree, proc_cpu, stat_cpu
from common import contracts
from common.kafka import consumer_config
from devstack.stack import LocalStack

ROOT = Path(__file__).resolve().parent.parent


def write_list(path: Path, rows: int, sites: int) -> None:
    """LAION-like rows: a URL (a few hosts per site, some without a scheme) and a caption."""
    urls = [f"{'https://' if n % 5 else ''}img{n % 4}.site{n % sites}.{'co.uk' if n % 3 else 'com'}"
            f"/images/{n // sites}/{n:09d}.jpg" for n in range(rows)]
    captions = [f"a photograph, number {n}, of something quite ordinary" for n in range(rows)]
    pq.write_table(pa.table({"url": urls, "caption": captions}), path, row_group_size=100_000)


def rss_kib(pid: int) -> tuple[int, int]:
    """(the process's own resident KiB, with its descendants)."""
    own = tree = 0
    for member in _tree(pid):
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:
            continue
        kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        tree += kib
        own = kib if member == pid else own
    return own, tree


def produce(path: Path, env: dict[str, str], work: Path, processes: int | None) -> dict[str, float]:
    argv = [sys.executable, "-m", "url_lists.list_producer", str(path), "--restart",
            "--progress-file", str(work / f"{path.stem}.progress.json")]
    if processes is not None:
        argv += ["--processes-count", str(processes)]
    peaks = [0, 0]
    cpu: dict[int, float] = {}  # pid -> its own CPU seconds, last seen
    started = time.perf_counter()
    child = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def sample() -> None:
        while child.poll() is None:
            own, tree = rss_kib(child.pid)
            peaks[0], peaks[1] = max(peaks[0], own), max(peaks[1], tree)
            for member in _tree(child.pid):
                try:
                    cpu[member] = stat_cpu(Path(f"/proc/{member}/stat"))
                except (OSError, IndexError):
                    continue
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = child.communicate()
    seconds = time.perf_counter() - started
    sampler.join()
    if child.returncode != 0:
        raise SystemExit(f"the producer failed: {err.decode()[-2000:]}")
    final = json.loads(out.decode().splitlines()[-1])
    rows = pq.ParquetFile(path).metadata.num_rows
    return {"rows": rows, "sent": final["sent"], "bad_rows": final["bad_rows"], "seconds": round(seconds, 2),
            "rows_per_s": round(rows / seconds),
            # CPU of the producer and its pool (sampled: the last 50 ms of each are missed), per row
            "cpu_us_per_row": round(sum(cpu.values()) / rows * 1e6, 1),
            "peak_rss_mib_producer": round(peaks[0] / 1024, 1),
            "peak_rss_mib_with_pool": round(peaks[1] / 1024, 1)}


def inbound_count(hosts: str) -> int:
    """Messages in inbound_images, read to each partition's end (tansu's ListOffsets high
    watermarks lag behind what a fetch returns, so they are not counted on)."""
    consumer = Consumer(consumer_config(hosts, "bench-producer-count", **{"enable.partition.eof": True}))
    try:
        topic = consumer.list_topics(contracts.INBOUND_TOPIC, timeout=10).topics[contracts.INBOUND_TOPIC]
        consumer.assign([TopicPartition(contracts.INBOUND_TOPIC, p, 0) for p in topic.partitions])
        left, total = set(topic.partitions), 0
        while left:
            for message in consumer.consume(num_messages=10_000, timeout=1.0):
                error = message.error()
                if error is None:
                    total += 1
                elif error.code() == KafkaError._PARTITION_EOF:
                    left.discard(message.partition())
        return total
    finally:
        consumer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--short", type=int, default=200_000)
    parser.add_argument("--sites", type=int, default=20_000)
    parser.add_argument("--processes", type=int, default=None, help="--processes-count (default: the producer's)")
    args = parser.parse_args()
    local = LocalStack()
    with tempfile.TemporaryDirectory(prefix="bench-producer-") as scratch, local as stack:
        work = Path(scratch)
        servers = {server.name: server.process.pid for server in local.servers if server.process}
        env = {**os.environ, **stack.environment(), "PYTHONPATH": str(ROOT)}
        results = {}
        for rows in (args.short, args.rows):
            path = work / f"list-{rows}.parquet"
            write_list(path, rows, args.sites)
            before = inbound_count(stack.kafka_hosts)
            load_before = os.getloadavg()[0]
            servers_before = {name: proc_cpu([pid]) for name, pid in servers.items()}
            result = produce(path, env, work, args.processes)
            # The broker's (and Redis's) CPU per row too: with the producer's, what a row costs the machine.
            result["servers_cpu_us_per_row"] = {
                name: round((proc_cpu([pid]) - servers_before[name]) / rows * 1e6, 1) for name, pid in servers.items()}
            result["in_kafka"] = inbound_count(stack.kafka_hosts) - before
            result["load_average_1m_before"] = round(load_before, 2)
            results[rows] = result
            print(json.dumps({"bench": "producer", **result}), flush=True)
        short, long_ = results[args.short], results[args.rows]
        print(json.dumps({
            "bench": "producer", "summary": True, "target_rows_per_s": 50_000,
            "rows_per_s": long_["rows_per_s"],
            "peak_rss_ratio_long_to_short_producer": round(
                long_["peak_rss_mib_producer"] / short["peak_rss_mib_producer"], 2),
            "peak_rss_ratio_long_to_short_with_pool": round(
                long_["peak_rss_mib_with_pool"] / short["peak_rss_mib_with_pool"], 2),
            "length_ratio": round(args.rows / args.short, 1), "cpus": os.cpu_count(),
            "load_average_1m_after": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
