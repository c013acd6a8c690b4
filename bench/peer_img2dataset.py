"""This crawler against img2dataset on one URL list of the simulated web, side by side.

Run by hand: ``.venv/bin/python -m bench.peer_img2dataset [--urls 2000]``. img2dataset
lives in its own venv (``bench/.venv-img2dataset``, made on first use with
``python3 -m venv`` and pip) because its dependencies clash with ours.

Both get the same photos (scikit-image samples, 120-1600 px, every format)
behind the same 10 loopback sites with 50 ms latency, two processes each,
and produce the same output: JPEG quality 85, at most 640 px on the longer
side. This crawler runs with every politeness rule on (robots.txt, per-host
cap, token buckets at 200 req/s a source) except the private-network guard,
which loopback needs off; as the ten sites share 127.0.0.1, the per-host cap
is the sum ten hosts would get (8 each). Throughput is measured twice: end to end (process
start to last outcome) and over the span the websites saw requests in, with the
seconds each took to its first request (this crawler's workers wait ~3 s for
Kafka's consumer group to assign them partitions, a fixed cost per start). CPU is
``getrusage(RUSAGE_CHILDREN)`` around each run, so every process of the run
and their pools count; this crawler's servers (Kafka, Redis, S3), which
img2dataset does without, are shown apart, read from /proc.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import resource
import statistics
import subprocess
import tempfile
import time
import uuid as uuidlib
from dataclasses import dataclass
from pathlib import Path

from bench.cpu import proc_cpu
from demo.crawl import crawl
from demo.outcomes import QUALITY
from demo.sample import PHOTOS, _photo, variant
from devstack.stack import LocalStack
from demo.simweb import RULES_PATHS, Planned, SimWeb, SiteSpec

ROOT = Path(__file__).resolve().parent.parent
PEER_VENV = ROOT / "bench" / ".venv-img2dataset"
PEER_BIN = PEER_VENV / "bin" / "img2dataset"
SOURCES, DISTINCT_IMAGES, LATENCY = 10, 120, 0.05
PROCESSES, PEER_THREADS = 2, 64
# The ten sites share 127.0.0.1, so the per-host cap is what ten hosts would allow together.
PER_HOST_CONNECTIONS = 8 * SOURCES
TARGET, JPEG_QUALITY = 640, 85  # TARGET_RESOLUTION's default and the worker's thumbnail quality
TIMEOUT = 900.0


@dataclass(frozen=True)
class Result:
    system: str
    images: int
    wall: float
    server_span: float
    cpu: float
    first_request: float  # seconds from the start to the sites' first image request
    server_cpu: dict[str, float] | None = None  # server name -> CPU seconds over the run

    @property
    def infra_cpu(self) -> float | None:
        return None if self.server_cpu is None else sum(self.server_cpu.values())

    @property
    def rate(self) -> float:
        return self.images / self.wall

    @property
    def span_rate(self) -> float:
        return self.images / self.server_span

    @property
    def cpu_per_image(self) -> float:
        return self.cpu / self.images

    @property
    def cpu_per_image_with_servers(self) -> float:
        return (self.cpu + (self.infra_cpu or 0.0)) / self.images

    def row(self) -> str:
        infra = "-" if self.infra_cpu is None else f"{self.cpu_per_image_with_servers * 1000:.1f}"
        return (f"{self.system:<16}{self.images:>7}{self.wall:>9.1f}{self.rate:>11.1f}"
                f"{self.span_rate:>13.1f}{self.first_request:>14.1f}"
                f"{self.cpu_per_image * 1000:>14.1f}{infra:>18}")


HEADER = (f"{'system':<16}{'images':>7}{'wall s':>9}{'img/s e2e':>11}{'img/s server':>13}"
          f"{'1st request s':>14}{'CPU ms/img':>14}{'+servers ms/img':>18}")


def build_web(urls: int) -> tuple[list[SiteSpec], list[Planned]]:
    rng = random.Random(2)
    photos = {name: _photo(name) for name in PHOTOS}
    bodies = [variant(rng, photos) for _ in range(DISTINCT_IMAGES)]
    specs = []
    for s in range(SOURCES):
        files = {f"/p/{s}/{k}.{ext}": body for k, (ext, body) in enumerate(bodies)}
        specs.append(SiteSpec(f"bench{s:02d}", 500_000_000, files, latency=LATENCY,
                              robots_txt="User-agent: *\nAllow: /\n"))
    paths = [(spec.name, path) for spec in specs for path in spec.files]
    plan = [Planned(str(uuidlib.uuid4()), name, path, frozenset({QUALITY}))
            for name, path in (paths[i % len(paths)] for i in range(urls))]
    rng.shuffle(plan)
    return specs, plan


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def image_requests(web: SimWeb) -> list[float]:
    return sorted(r.time for r in web.all_requests() if r.path not in RULES_PATHS)


def ensure_peer() -> None:
    if PEER_BIN.exists():
        return
    print(f"installing img2dataset into {PEER_VENV} ...", flush=True)
    subprocess.run(["python3", "-m", "venv", str(PEER_VENV)], check=True)
    subprocess.run([str(PEER_VENV / "bin" / "pip"), "install", "--quiet", "img2dataset"], check=True)


def sites_log(work: Path, keep: bool, system: str) -> Path | None:
    """Where the sites log each request (``--keep`` only: the log costs the sites' CPU)."""
    return work / f"requests-{system}.jsonl" if keep else None


def run_peer(specs: list[SiteSpec], plan: list[Planned], work: Path, keep: bool) -> Result:
    web = SimWeb(specs, log_path=sites_log(work, keep, "img2dataset"))
    with web.serving():
        url_list = work / "urls.txt"
        url_list.write_text("".join(web.sites[p.source].url(p.path) + "\n" for p in plan))
        out = work / "img2dataset"
        argv = [str(PEER_BIN), "--url_list", str(url_list), "--output_folder", str(out),
                "--processes_count", str(PROCESSES), "--thread_count", str(PEER_THREADS),
                "--image_size", str(TARGET), "--resize_mode", "keep_ratio_largest",
                "--resize_only_if_bigger", "True", "--encode_format", "jpg",
                "--encode_quality", str(JPEG_QUALITY), "--output_format", "files",
                "--number_sample_per_shard", "1000", "--timeout", "30", "--retries", "1"]
        env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1", "PYTHONPATH": ""}
        cpu0, started, wall_clock = children_cpu(), time.monotonic(), time.time()
        with open(work / "img2dataset.log", "wb") as log:
            subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=TIMEOUT)
        wall, cpu = time.monotonic() - started, children_cpu() - cpu0
    times = image_requests(web)
    return Result("img2dataset", len(list(out.glob("*/*.jpg"))), wall, times[-1] - times[0], cpu,
                  times[0] - wall_clock)


def run_ours(specs: list[SiteSpec], plan: list[Planned], work: Path, keep: bool) -> Result:
    web = SimWeb(specs, log_path=sites_log(work, keep, "ours"))
    stack = LocalStack(work / "stack")
    with stack as addresses:
        servers = {s.name: s.process.pid for s in stack.servers if s.process}
        base = {**os.environ, **addresses.environment(), "PYTHONPATH": str(ROOT)}
        servers0 = {name: proc_cpu([pid]) for name, pid in servers.items()}
        cpu0, started, wall_clock = children_cpu(), time.monotonic(), time.time()
        with crawl(web, plan, base, work / "ours", PROCESSES,
                   CRAWL_PER_HOST_CONNECTIONS=str(PER_HOST_CONNECTIONS)) as (cluster, outcomes):
            if not outcomes.wait(TIMEOUT):
                raise RuntimeError(f"{len(outcomes.missing())} URLs without an outcome (offsets the reader "
                                   f"skipped: {outcomes.gaps[:10]}); see {work / 'ours'}")
            wall = time.monotonic() - started
            server_cpu = {name: proc_cpu([pid]) - servers0[name] for name, pid in servers.items()}
            cluster.stop()
        cpu = children_cpu() - cpu0
    times = image_requests(web)
    return Result("this crawler", outcomes.totals()[QUALITY], wall, times[-1] - times[0], cpu,
                  times[0] - wall_clock, server_cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--urls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=1, help="alternate the two this many times")
    parser.add_argument("--keep", type=Path, help="run in this folder and keep its logs, the sites' requests too "
                        "(default: a temporary one)")
    parser.add_argument("--one-command", type=int, nargs="?", const=20_000, metavar="URLS",
                        help="instead: img2dataset and python -m url_lists crawl, one command each, on the same "
                             "list of URLS (20,000), webdataset, timed from command start to exit "
                             "(bench/peer_one_command.py)")
    args = parser.parse_args()
    ensure_peer()
    if args.one_command:
        from bench import peer_one_command
        with contextlib.nullcontext(str(args.keep)) if args.keep else tempfile.TemporaryDirectory(
                prefix="bench-peer-") as tmp:
            peer_one_command.main(args.one_command, args.rounds, Path(tmp))
        return
    specs, plan = build_web(args.urls)
    kept = contextlib.nullcontext(str(args.keep)) if args.keep else None
    with kept or tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
        work = Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results: list[Result] = []
        keep = args.keep is not None
        for round_ in range(args.rounds):  # alternating, so a noisy neighbour hits both alike
            folder = work / str(round_)
            folder.mkdir()
            results += [run_peer(specs, plan, folder, keep), run_ours(specs, plan, folder, keep)]
    print(f"\n{args.urls} URLs, {SOURCES} sites, {LATENCY * 1000:.0f} ms latency, {PROCESSES} processes each, "
          f"{TARGET} px JPEG q{JPEG_QUALITY}; {os.cpu_count()} cores")
    print(HEADER)
    for result in results:
        print(result.row())
    pairs = list(zip(results[::2], results[1::2], strict=True))
    for peer, ours in pairs:
        print(f"this crawler / img2dataset: {ours.rate / peer.rate:.0%} e2e, "
              f"{ours.span_rate / peer.span_rate:.0%} over the span; "
              f"CPU per image {ours.cpu_per_image / peer.cpu_per_image:.0%}, "
              f"{ours.cpu_per_image_with_servers / peer.cpu_per_image:.0%} with the servers")
    if len(pairs) > 2:  # a round's ratio moves with the machine's minute: the spread says how much
        e2e = sorted(ours.rate / peer.rate for peer, ours in pairs)
        cpu = sorted(ours.cpu_per_image / peer.cpu_per_image for peer, ours in pairs)
        print(f"over {len(pairs)} rounds: e2e median {statistics.median(e2e):.0%} ({e2e[0]:.0%}-{e2e[-1]:.0%}), "
              f"CPU per image median {statistics.median(cpu):.0%} ({cpu[0]:.0%}-{cpu[-1]:.0%})")
    for result in results:
        if result.server_cpu:
            print("servers' CPU ms/img: " + ", ".join(
                f"{name} {seconds / result.images * 1000:.2f}" for name, seconds in result.server_cpu.items()))


if __name__ == "__main__":
    main()
