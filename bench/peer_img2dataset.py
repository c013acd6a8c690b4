"""This crawler against img2dataset on one URL list of the simulated web, side by side.

Run by hand: ``.venv/bin/python -m bench.peer_img2dataset [--urls 2000] [--shape real]``. img2dataset
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

``--shape real`` runs both on a list shaped like a real one (``bench/list_shape.py``,
``bench/real_web.py``; default 4,000 rows): a few big sites hold a large share of the
URLs (the busiest 6.5%), most sites have one or two; host names under reserved TLDs
(``img.shopcdn.example``), each on its own loopback address at port 80, resolved by
both crawlers from a hosts file only (our workers run as ``test.resolving_worker``;
img2dataset gets a ``sitecustomize`` on its PYTHONPATH, in every process it starts);
nothing asks DNS. Most sites answer in 50-300 ms at any rate; four are fragile (2-3
slots, so their latency climbs past a few concurrent requests); some forbid everything
in robots.txt, some answer 500 to everything, the busiest answers 500 to 2%, some hosts
have no server, and 1 URL in 33 is a 404. Both read the same Parquet file: this crawler
through ``url_lists.list_producer`` (each site rated by its count in the list, as a real
list crawl is), with every politeness rule on but the private-network guard and the
per-host cap at its default; ``--env NAME=VALUE`` passes it a setting. Each round runs this
crawler in each configuration ``--ours`` names, after img2dataset: ``folder``, as ``python -m
url_lists crawl`` runs it (thumbnails written into a folder, as img2dataset writes its files;
no S3 server), and ``s3``, the stack's default (thumbnails PUT to the local S3). Printed for each:
the time to the last outcome (this crawler's round stops at ``--timeout`` and is reported
unfinished; URLs of dead hosts wait for their robots.txt by design, so they are counted
apart), images a second, CPU per image, the busiest site's most requests in a second,
requests to sites whose robots.txt forbids everything, the circuit breaker's halts; and
each fragile site's median latency under each crawler against its unloaded median,
both as the site measures them (arrival to answer; the unloaded one from sequential
requests before the rounds).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import statistics
import subprocess
import tempfile
import time
import uuid as uuidlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.cpu import KindSampler, per_image_by_kind, proc_cpu
from bench.grant_trace import GrantSampler, format_rows, trace_rows
from common.contracts import EVENT_CRAWL_HALTED
from bench.real_web import RealWeb, SitesSaw, build_real_web, sites_saw, unloaded_latency, write_sitecustomize
from bench.web_apart import LATE_SECONDS, WebApart
from demo.crawl import crawl
from demo.outcomes import QUALITY
from demo.sample import PHOTOS, _photo, variant
from devstack.stack import LocalStack
from demo.simweb import Planned, SimWeb, SiteSpec, fetches
from test.resolving_worker import HOSTS_FILE_ENV

ROOT = Path(__file__).resolve().parent.parent
PEER_VENV = ROOT / "bench" / ".venv-img2dataset"
PEER_BIN = PEER_VENV / "bin" / "img2dataset"
SOURCES, DISTINCT_IMAGES, LATENCY = 10, 120, 0.05
PROCESSES, PEER_THREADS = 2, 64
# The ten sites share 127.0.0.1, so the per-host cap is what ten hosts would allow together.
PER_HOST_CONNECTIONS = 8 * SOURCES
TARGET, JPEG_QUALITY = 640, 85  # TARGET_RESOLUTION's default and the worker's thumbnail quality
TIMEOUT = 900.0
REAL_URLS, REAL_TIMEOUT = 4000, 600.0
# This crawler's configurations in the real-shaped rounds: where its thumbnails go.
FOLDER, S3 = "folder", "s3"
OURS = {FOLDER: "ours (folder)", S3: "ours (S3)"}


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


def image_requests(web: SimWeb | WebApart) -> list[float]:
    return sorted(r.time for r in fetches(web.all_requests()))


def ensure_peer() -> None:
    if PEER_BIN.exists():
        return
    print(f"installing img2dataset into {PEER_VENV} ...", flush=True)
    subprocess.run(["python3", "-m", "venv", str(PEER_VENV)], check=True)
    subprocess.run([str(PEER_VENV / "bin" / "pip"), "install", "--quiet", "img2dataset"], check=True)


def sites_log(work: Path, keep: bool, system: str) -> Path | None:
    """Where the sites log each request (``--keep`` only: the log costs the sites' CPU)."""
    return work / f"requests-{system}.jsonl" if keep else None


def img2dataset(url_list: Path, work: Path, **env: str) -> tuple[float, float, int]:
    """Run img2dataset on ``url_list`` (txt, or Parquet with a ``url`` column): (wall, CPU, images)."""
    out = work / "img2dataset"
    kind = "parquet" if url_list.suffix == ".parquet" else "txt"
    argv = [str(PEER_BIN), "--url_list", str(url_list), "--input_format", kind, "--url_col", "url",
            "--output_folder", str(out),
            "--processes_count", str(PROCESSES), "--thread_count", str(PEER_THREADS),
            "--image_size", str(TARGET), "--resize_mode", "keep_ratio_largest",
            "--resize_only_if_bigger", "True", "--encode_format", "jpg",
            "--encode_quality", str(JPEG_QUALITY), "--output_format", "files",
            "--number_sample_per_shard", "1000", "--timeout", "30", "--retries", "1"]
    full_env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1", "PYTHONPATH": "", **env}
    cpu0, started = children_cpu(), time.monotonic()
    with open(work / "img2dataset.log", "wb") as log:
        subprocess.run(argv, env=full_env, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=TIMEOUT)
    return time.monotonic() - started, children_cpu() - cpu0, len(list(out.glob("*/*.jpg")))


def run_peer(specs: list[SiteSpec], plan: list[Planned], work: Path, keep: bool) -> Result:
    web = SimWeb(specs, log_path=sites_log(work, keep, "img2dataset"))
    with web.serving():
        url_list = work / "urls.txt"
        url_list.write_text("".join(web.sites[p.source].url(p.path) + "\n" for p in plan))
        wall_clock = time.time()
        wall, cpu, images = img2dataset(url_list, work)
    times = image_requests(web)
    return Result("img2dataset", images, wall, times[-1] - times[0], cpu, times[0] - wall_clock)


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


@dataclass(frozen=True)
class RealRun:
    """One crawler's round on the real-shaped list."""

    system: str
    outcomes: int          # URLs that got their outcome
    images: int
    last_outcome: float    # seconds from the start to the last outcome (or to the timeout)
    finished: bool
    cpu: float
    saw: SitesSaw
    server_cpu: float | None = None  # this crawler's servers (Kafka, Redis, S3)
    halts: tuple[int, int] = (0, 0)  # the breaker's halts of the busiest site, of all sites
    first_request: float = 0.0       # seconds from the start to the sites' first image request
    span: float = 0.0                # seconds from the sites' first image request to their last
    busiest_done: float = 0.0        # seconds from the start to the busiest site's last image request
    waiting: dict[str, int] = field(default_factory=dict)  # site -> its URLs without an outcome
    web_late: list[float] = field(default_factory=list)  # seconds the simulated web's loop ran late, each time
    web_gc: list[float] = field(default_factory=list)    # seconds of each of its full garbage collections
    split: dict[str, float] = field(default_factory=dict)  # process kind -> CPU seconds (the bench's own apart)
    last_sites: tuple[tuple[str, float], ...] = ()  # the sites asked last: (site, s after the first image request)
    trace: tuple[str, ...] = ()  # --trace: each traced site's grant beside its requests (bench.grant_trace)

    def row(self, urls: int) -> str:
        last = f"{self.last_outcome:.1f}" if self.finished else f">{self.last_outcome:.0f} (unfinished)"
        servers = "-" if self.server_cpu is None else f"{(self.cpu + self.server_cpu) / max(1, self.images) * 1000:.1f}"
        return (f"{self.system:<14}{last:>20}{self.outcomes:>7}/{urls:<6}{self.images:>7}"
                f"{self.images / self.last_outcome:>8.1f}{self.cpu / max(1, self.images) * 1000:>9.1f}{servers:>10}"
                f"{self.saw.busiest_peak:>9}{self.saw.fastest_peak[1]:>9}{self.saw.disallowed_requests:>12}"
                f"{self.first_request:>9.1f}{self.span:>8.1f}{self.busiest_done:>14.1f}")


REAL_HEADER = (f"{'system':<14}{'last outcome s':>20}{'outcomes':>14}{'images':>7}{'img/s':>8}{'CPU ms':>9}"
               f"{'+servers':>10}{'busiest':>9}{'peak':>9}{'disallowed':>12}{'1st req':>9}{'span':>8}"
               f"{'busiest done':>14}")
REAL_LEGEND = ("CPU ms: per image, the crawler's processes (+servers: with Kafka, Redis and, for ours (S3), S3); "
               "busiest: the busiest site's most requests in one second; peak: any site's; disallowed: "
               "requests (not robots.txt) to sites whose robots.txt forbids everything; 1st req: seconds "
               "from the start to the sites' first image request; span: from it to their last; busiest "
               "done: to the busiest site's last")


def run_peer_real(real: RealWeb, url_list: Path, hosts_file: Path, resolver: Path, work: Path,
                  keep: bool) -> RealRun:
    web = WebApart(real.specs, log_path=sites_log(work, keep, "img2dataset"))
    with web.serving():
        wall_clock = time.time()
        sampler = KindSampler(os.getpid(), skip=frozenset({web.pid or 0}), root_kind="bench")
        wall, cpu, images = img2dataset(url_list, work, PYTHONPATH=str(resolver), TEST_HOSTS_FILE=str(hosts_file))
        split = sampler.split()
    times = image_requests(web)
    return RealRun("img2dataset", len(real.plan), images, wall, True, cpu, sites_saw(real, web),
                   first_request=times[0] - wall_clock, span=times[-1] - times[0],
                   busiest_done=busiest_last(real, web) - wall_clock, web_late=[late for _, late in web.late],
                   web_gc=[took for _, took in web.collections], split=split, last_sites=last_sites(web, times[0]))


def run_ours_real(real: RealWeb, url_list: Path, hosts_file: Path, work: Path, keep: bool, timeout: float,
                  settings: dict[str, str], trace: tuple[str, ...] = (), configuration: str = S3) -> RealRun:
    """Every politeness rule on but the private-network guard; each site rated by its count in
    the list (the list producer); workers that resolve from the hosts file only. ``configuration``
    FOLDER: thumbnails into a folder and no S3 server, as the one command runs; S3: the stack's."""
    web = WebApart(real.specs, log_path=sites_log(work, keep, configuration))
    stack = LocalStack(work / f"stack-{configuration}", s3=configuration == S3)
    if configuration == FOLDER:
        settings = {"THUMBNAIL_DIR": str(work / f"thumbnails-{configuration}"), **settings}
    with web.serving(), stack as addresses:  # the web's CPU is its own: it stops after the count
        servers = [s.process.pid for s in stack.servers if s.process]
        base = {**os.environ, **addresses.environment(), "PYTHONPATH": str(ROOT)}
        servers0, cpu0, started, wall_clock = proc_cpu(servers), children_cpu(), time.monotonic(), time.time()
        sampler = KindSampler(os.getpid(), skip=frozenset({web.pid or 0}), root_kind="bench")
        with GrantSampler(addresses.redis_url, trace) as grants, \
                crawl(web, real.plan, base, work / configuration, PROCESSES, worker_module="test.resolving_worker",
                      url_list=url_list, **{HOSTS_FILE_ENV: str(hosts_file)}, **settings) as (cluster, outcomes):
            # A dead host's robots.txt is an outage: its URLs wait (ROBOTS_UNAVAILABLE_GIVE_UP), counted apart.
            live = {p.uuid for p in real.plan if p.source not in real.dead_sites}
            deadline = started + timeout
            while not live.issubset(outcomes.kinds) and time.monotonic() < deadline:
                outcomes.poll(0.1)
            last, finished = time.monotonic() - started, live.issubset(outcomes.kinds)
            server_cpu = proc_cpu(servers) - servers0
            cluster.stop()
        cpu = children_cpu() - cpu0
        split = sampler.split()
    waiting = Counter(p.source for p in real.plan if p.uuid not in outcomes.kinds)
    times = image_requests(web)
    return RealRun(OURS[configuration], len(outcomes.kinds), outcomes.totals()[QUALITY], last, finished, cpu,
                   sites_saw(real, web), server_cpu, halts(work / configuration / "monitor.log", real.sites[0].site),
                   waiting=dict(waiting.most_common()), first_request=times[0] - wall_clock,
                   span=times[-1] - times[0], busiest_done=busiest_last(real, web) - wall_clock,
                   web_late=[late for _, late in web.late],
                   web_gc=[took for _, took in web.collections], split=split, last_sites=last_sites(web, times[0]),
                   trace=tuple(line for site in trace  # a list site's source is its name
                               for line in format_rows(site, trace_rows(grants.samples[site], web.sites[site].log,
                                                                        times[0]))))


def last_sites(web: WebApart, first: float, most: int = 3) -> tuple[tuple[str, float], ...]:
    """The ``most`` sites whose last image request came last, with its seconds after ``first``:
    what ended a round, even one whose logs were not kept."""
    last = {name: max((r.time for r in fetches(site.log)), default=first)
            for name, site in web.sites.items()}
    return tuple((name, at - first) for name, at in sorted(last.items(), key=lambda item: -item[1])[:most])


def busiest_last(real: RealWeb, web: WebApart) -> float:
    """When the busiest site saw its last image request (wall clock)."""
    return max(r.time for r in fetches(web.sites[real.sites[0].site].log))


def halts(monitor_log: Path, busiest: str) -> tuple[int, int]:
    """The circuit breaker's halts in the monitor's log: (of the ``busiest`` site, of all)."""
    events = []
    for line in monitor_log.read_text(errors="replace").splitlines():
        if EVENT_CRAWL_HALTED in line:
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    halted = [e.get("source") for e in events if e.get("event") == EVENT_CRAWL_HALTED]
    return halted.count(busiest), len(halted)


def main_real(args: argparse.Namespace) -> None:
    ensure_peer()
    real = build_real_web(args.urls or REAL_URLS, args.seed, args.port)
    unknown = sorted(set(args.trace) - {spec.name for spec in real.specs})
    if unknown:  # before the rounds: the trace is read after each
        raise SystemExit(f"--trace: no live site {', '.join(unknown)} in the list (its busiest: {real.sites[0].site})")
    settings = dict(item.split("=", 1) for item in args.env)
    unloaded = unloaded_latency(real)
    kept = contextlib.nullcontext(str(args.keep)) if args.keep else None
    runs: list[tuple[RealRun, ...]] = []  # a round: img2dataset's run, then ours in each configuration
    with kept or tempfile.TemporaryDirectory(prefix="bench-peer-real-") as tmp:
        work = Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        url_list, hosts_file = real.write(work)
        resolver = write_sitecustomize(work / "resolver")
        keep = args.keep is not None
        for round_ in range(args.rounds):  # alternating, so a noisy neighbour hits both alike
            folder = work / str(round_)
            folder.mkdir()
            peer = run_peer_real(real, url_list, hosts_file, resolver, folder, keep)
            ours = tuple(run_ours_real(real, url_list, hosts_file, folder, keep, args.timeout, settings,
                                       tuple(args.trace), configuration) for configuration in args.ours)
            runs.append((peer, *ours))
            print(f"round {round_ + 1}: img2dataset {peer.last_outcome:.1f} s, " + ", ".join(
                f"{run.system} {run.last_outcome:.1f} s{'' if run.finished else ' (did not finish)'}"
                for run in ours), flush=True)
    report_real(real, runs, unloaded, args, settings)


def report_real(real: RealWeb, runs: list[tuple[RealRun, ...]], unloaded: dict[str, float | None],
                args: argparse.Namespace, settings: dict[str, str]) -> None:
    print(f"\nreal-shaped list (seed {args.seed}): {real.describe()}")
    print(f"{PROCESSES} processes each, {TARGET} px JPEG q{JPEG_QUALITY}; {os.cpu_count()} cores; this crawler's "
          f"settings: {settings or 'defaults'}; its round capped at {args.timeout:.0f} s")
    print(REAL_HEADER)
    for round_ in runs:
        for run in round_:
            print(run.row(len(real.plan)))
    print(REAL_LEGEND)
    for n, (peer, *ours) in enumerate(runs, 1):
        for run in ours:
            dead = sum(run.waiting.get(name, 0) for name in real.dead_sites)
            others = {name: count for name, count in run.waiting.items() if name not in real.dead_sites}
            print(f"round {n}: {run.system}: the breaker halted the busiest site {run.halts[0]} times, "
                  f"{run.halts[1]} halts in all; {dead} URLs of dead hosts wait for robots.txt (not counted)"
                  + (f"; without an outcome: {list(others.items())[:5]}" if others else ""))
        print(f"round {n}: the simulated web ran late (> {LATE_SECONDS} s) "
              + "; ".join(f"under {run.system} {len(run.web_late)} times, at most {max(run.web_late, default=0):.2f} s "
                          f"({len(run.web_gc)} full collections, the longest {max(run.web_gc, default=0):.2f} s)"
                          for run in (peer, *ours)))
        print(f"round {n}: the sites asked last, seconds after the first image request: "
              + "; ".join(f"{run.system} " + ", ".join(f"{site} {at:.1f}" for site, at in run.last_sites)
                          for run in (peer, *ours)))
        print(f"round {n}: CPU ms an image by process kind (sampled every 0.5 s): "
              + "; ".join(f"{run.system}: {per_image_by_kind(run.split, run.images)}" for run in (peer, *ours)))
        for run in ours:
            verdict = (f"{run.last_outcome / peer.last_outcome:.2f}x img2dataset's" if run.finished else
                       f"did not finish in {run.last_outcome:.0f} s ({run.outcomes} of {len(real.plan)} outcomes), "
                       f"over {run.last_outcome / peer.last_outcome:.1f}x img2dataset's")
            print(f"round {n}: {run.system}: time to the last outcome {verdict}; CPU per image "
                  f"{run.cpu / max(1, run.images) / (peer.cpu / max(1, peer.images)):.0%} of img2dataset's")
            if run.trace:
                print(f"round {n}: {run.system}: the grant beside the traced sites' requests:", *run.trace, sep="\n")
    if len(runs) > 1:  # a round's ratio moves with the machine's minute: the spread says how much
        for index, configuration in enumerate(args.ours, 1):
            times = sorted(round_[index].last_outcome / round_[0].last_outcome for round_ in runs)
            print(f"over {len(runs)} rounds: {OURS[configuration]}: time to the last outcome "
                  f"{statistics.median(times):.2f}x img2dataset's (median; {times[0]:.2f}-{times[-1]:.2f}x), "
                  f"{sum(round_[index].finished for round_ in runs)} rounds finished")
    for index, system in enumerate(("img2dataset", *(OURS[c] for c in args.ours))):
        worst = [max((round_[index].saw.fragile_ms[s.site] or 0.0) / (unloaded[s.site] or 1.0) for s in real.fragile)
                 for round_ in runs]
        print(f"{system}: the worst fragile site's median latency per round: "
              + ", ".join(f"{ratio:.1f}x" for ratio in worst) + " its unloaded")
    print("fragile sites, median latency at the site (ms), x its unloaded median:")
    for site in real.fragile:
        base = unloaded[site.site]
        cells = []
        for n, round_ in enumerate(runs, 1):
            for run in round_:
                ms = run.saw.fragile_ms[site.site]
                cells.append(f"r{n} {run.system} "
                             + ("-" if ms is None or base is None else f"{ms:.0f} ({ms / base:.1f}x)"))
        print(f"  {site.host} ({site.urls} URLs, {site.slots} slots): unloaded "
              f"{'-' if base is None else f'{base:.0f}'}; " + ", ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("uniform", "real"), default="uniform",
                        help="uniform: 10 equal sites (default); real: a list shaped like LAION's")
    parser.add_argument("--urls", type=int, help=f"URLs in the list (default: 2000 uniform, {REAL_URLS} real)")
    parser.add_argument("--seed", type=int, default=41, help="the real-shaped list's seed")
    parser.add_argument("--port", type=int, default=80 if os.geteuid() == 0 else 8080,
                        help="the real-shaped sites' port, on each site's own loopback address")
    parser.add_argument("--timeout", type=float, default=REAL_TIMEOUT,
                        help="real: seconds this crawler's round may take before it is reported unfinished")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="real: a setting for this crawler's processes (repeatable)")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the crawlers this many times")
    parser.add_argument("--ours", action="append", choices=tuple(OURS), metavar="CONFIGURATION",
                        help=f"real: this crawler's configurations, each round (repeatable; default both): "
                             f"{FOLDER}: thumbnails into a folder, no S3 server, as python -m url_lists crawl runs; "
                             f"{S3}: thumbnails to the local S3, the stack's default")
    parser.add_argument("--keep", type=Path, help="run in this folder and keep its logs, the sites' requests too "
                        "(default: a temporary one)")
    parser.add_argument("--trace", action="append", default=[], metavar="SITE",
                        help="real: print each round's grant to SITE (e.g. craftpics.test) every 0.5 s beside its "
                             "requests and their median time (repeatable; bench/grant_trace.py)")
    parser.add_argument("--one-command", type=int, nargs="?", const=20_000, metavar="URLS",
                        help="instead: img2dataset and python -m url_lists crawl, one command each, on the same "
                             "list of URLS (20,000), webdataset, timed from command start to exit "
                             "(bench/peer_one_command.py)")
    args = parser.parse_args()
    if args.shape == "real":
        args.ours = args.ours or [FOLDER, S3]
        main_real(args)
        return
    args.urls = args.urls or 2000
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
