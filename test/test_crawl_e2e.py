"""``python -m url_lists crawl`` end to end, as a user runs it: one command, a Parquet list with
captions and an additional column, nothing else started by the test.

The simulated web has many sites, each on a loopback address of its own (names from a hosts
file, never DNS: ``test.resolving_crawl`` runs the command with ``test.resolving_worker``
workers), with dead links, broken files, some invalid rows and one site whose robots.txt
forbids everything. The command starts its own stack, monitor and workers (embedded mode),
and must end with one output row per input row, every success an image that decodes within
``--image_size`` beside its caption, stats that add up, each site's busiest second within
floor(its limit) + 1, and no process of its own left. SIGKILLed halfway and run again, it
crawls only what had no outcome and writes every row once.

The suite crawls 1,000 rows over 40 sites (25 a site at 1 request/s), SIGKILLed at 40% in
webdataset and SIGTERMed at 20% in parquet; ``pytest -m slow`` crawls the issue's 10,000 rows
over 300 sites the same two ways (SIGINT, as Ctrl-C sends it, for parquet).
"""
from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from common.contracts import allowed_per_second
from common.settings import DEFAULT_USER_AGENT
from crawl_monitor.sources import rate_for_size
from demo.cluster import Child, Cluster, module_argv
from demo.simweb import BROKEN, IMAGE, MISSING, SimWeb, SiteSpec, busiest_second, fetches
from test.resolving_worker import HOSTS_FILE_ENV
from test.test_e2e_crawl import crawl_env  # noqa: F401 - the fixture: a broker of this test's own
from url_lists.dataset.keys import sample_key
from url_lists.sites import site_of_host

ROOT = Path(__file__).resolve().parent.parent
IMAGE_SIZE, PER_SHARD, TOKEN = 64, 100, "e2e-dataset"
DISCOVERY_CEILING = 4  # capacity discovery grants a site at most this (req/s): small, so the pacing check bites
INVALID = ["not a url", "ftp://site1.test/x.jpg", "http://exa mple.test/x.jpg", None, "",
           "http://bad_.-host-.test/x.jpg"]
SERVER_SETTINGS = ("KAFKA_HOSTS", "REDIS_URL", "S3_ENDPOINT_URL", "S3_BUCKET")
SUCCESS, LINK_ROT, ERROR, OPTED_OUT = "success", "link_rot", "error", "opted_out"


def picture(n: int) -> bytes:
    """A JPEG from 40x30 to 139x89 px: most are larger than IMAGE_SIZE, some not."""
    buffer = io.BytesIO()
    Image.new("RGB", (40 + n % 100, 30 + n % 60), (n * 37 % 256, 90, 160)).save(buffer, "JPEG", quality=80)
    return buffer.getvalue()


class World:
    """The sites, their hosts file and the list; per row its expectation."""

    def __init__(self, tmp: Path, sites: int, rows: int):
        rng = random.Random(42)
        self.specs: list[SiteSpec] = []
        hosts: dict[str, str] = {}
        for i in range(sites):
            address = f"127.0.{100 + i // 250}.{1 + i % 250}"
            name = f"site{i:03d}.co.uk" if i % 2 else f"site{i:03d}.test"
            hosts[name] = hosts[f"img0.{name}"] = hosts[f"img1.{name}"] = address
            robots = "User-agent: *\nDisallow: /\n" if i == 0 else None  # site 0 forbids us everything
            self.specs.append(SiteSpec(name, 1, {}, host=address, seed=i, robots_txt=robots))
        self.hosts_file = tmp / "hosts.json"
        self.hosts_file.write_text(json.dumps(hosts))
        planned: list[dict[str, Any]] = []
        invalid = len(INVALID) * max(1, rows // 500)
        for n in range(rows - invalid):
            spec = self.specs[n % sites]
            kind = n % 10
            if spec.robots_txt:
                path, expect = f"{IMAGE}{n}.jpg", OPTED_OUT
                spec.files[path] = picture(n)
            elif kind == 1:
                path, expect = f"{MISSING}{n}.jpg", LINK_ROT
            elif kind == 2:
                path, expect = f"{BROKEN}{n}.jpg", ERROR
                spec.files[path] = b"<html>no image</html>"
            else:
                path, expect = f"{IMAGE}{n}.jpg", SUCCESS
                spec.files[path] = picture(n)
            host = f"img{n % 2}.{spec.name}" if spec.name.endswith(".co.uk") else spec.name
            planned.append({"host": host, "path": path, "site": spec.name, "expect": expect,
                            "scheme": "" if n % 7 == 3 else "http://", "caption": f"picture {n}", "n": n})
        planned += [{"invalid": value, "caption": "broken row", "n": -1} for value in INVALID * max(1, rows // 500)]
        rng.shuffle(planned)
        self.planned = planned
        self.web = SimWeb(self.specs, log_path=tmp / "requests.jsonl")
        self.list_path = tmp / "list.parquet"

    def write_list(self) -> None:
        """Once the sites have their ports. Row r of the list is the r-th planned row."""
        urls = []
        for row in self.planned:
            if "invalid" in row:
                urls.append(row["invalid"])
            else:
                urls.append(f"{row['scheme']}{row['host']}:{self.web.sites[row['site']].port}{row['path']}")
        pq.write_table(pa.table({"url": urls, "caption": [r["caption"] for r in self.planned],
                                 "license": [f"cc-by-{r['n']}" for r in self.planned]}),
                       self.list_path, row_group_size=300)

    def accepted(self) -> dict[str, dict[str, Any]]:
        return {sample_key(r, PER_SHARD): row for r, row in enumerate(self.planned) if "invalid" not in row}

    def bad(self) -> set[str]:
        return {sample_key(r, PER_SHARD) for r, row in enumerate(self.planned) if "invalid" in row}


def command_env(tmp: Path, world: World, marker: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in SERVER_SETTINGS}
    return {**env, "PYTHONPATH": str(ROOT), "CRAWL_ALLOW_PRIVATE_NETWORKS": "true", "PYTHONUNBUFFERED": "1",
            HOSTS_FILE_ENV: str(world.hosts_file), "CRAWL_E2E_MARKER": marker,
            "DISCOVERY_MAX_RATE": str(DISCOVERY_CEILING)}


def command(world: World, out: Path, output_format: str, processes: int = 2) -> list[str]:
    return [sys.executable, "-m", "test.resolving_crawl", "crawl", "--url_list", str(world.list_path),
            "--input_format", "parquet", "--url_col", "url", "--caption_col", "caption",
            "--save_additional_columns", "['license']", "--output_folder", str(out),
            "--output_format", output_format, "--number_sample_per_shard", str(PER_SHARD),
            "--image_size", str(IMAGE_SIZE), "--processes_count", str(processes),
            "--user_agent_token", TOKEN, "--thread_count", "64"]


def marked_processes(marker: str) -> list[int]:
    """Processes whose environment carries this run's marker: the command and all it started."""
    found = []
    needle = f"CRAWL_E2E_MARKER={marker}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if needle in environ.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def assert_none_left(marker: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = marked_processes(marker)
    assert not left, f"processes left running: {[Path(f'/proc/{p}/cmdline').read_bytes()[:120] for p in left]}"


def run_to_the_end(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stderr[-3000:]}\n{done.stdout[-2000:]}"
    return done


def image_requests(web: SimWeb) -> int:
    return sum(len(fetches(site.log)) for site in web.sites.values())


def output_rows(out: Path) -> list[dict[str, Any]]:
    shards = sorted(out.glob("[0-9]*.parquet"))
    assert shards, f"no shard in {out}: {sorted(p.name for p in out.iterdir())}"
    return [row for path in shards for row in pq.read_table(path).to_pylist()]


def check_dataset(world: World, out: Path, output_format: str) -> dict[str, int]:
    accepted, bad = world.accepted(), world.bad()
    rows = output_rows(out)
    keys = Counter(row["key"] for row in rows)
    assert not [k for k, n in keys.items() if n > 1], "a row written twice"
    assert set(keys) == set(accepted) | bad, (f"{len(set(accepted) - set(keys))} accepted rows missing, "
                                              f"{len(set(keys) - set(accepted) - bad)} unknown keys")
    by_key = {row["key"]: row for row in rows}
    wrong = [(k, by_key[k]["status"], want["expect"]) for k, want in accepted.items()
             if by_key[k]["status"] != want["expect"]]
    assert not wrong, f"{len(wrong)} rows with another outcome than their path calls for, e.g. {wrong[:3]}"
    assert all(by_key[k]["caption"] == want["caption"] and by_key[k]["license"] == f"cc-by-{want['n']}"
               for k, want in accepted.items()), "a caption or additional column that is not its row's"
    assert all(by_key[k]["status"] == ERROR for k in bad)
    robots_site = world.specs[0].name
    assert all((by_key[k]["error_message"] or "").startswith("robots-txt: ") for k, want in accepted.items()
               if want["site"] == robots_site), "an opt-out names the signal and value that decided"
    successes = {k for k, want in accepted.items() if want["expect"] == SUCCESS}
    images = samples(out, output_format)
    assert set(images) == successes, (f"{len(successes - set(images))} successes without an image, "
                                      f"{len(set(images) - successes)} images of no success")
    for key, (image, caption) in images.items():
        with Image.open(io.BytesIO(image)) as decoded:
            decoded.load()
            assert max(decoded.size) <= IMAGE_SIZE, (key, decoded.size)
        assert caption is None or caption == accepted[key]["caption"]
    stats = json.loads((out / "stats.json").read_text())
    counted = Counter(row["status"] for row in rows)
    totals = stats["totals"]
    assert (totals["successes"], totals["link_rot"], totals["errors"]) == (
        counted[SUCCESS], counted[LINK_ROT], counted[ERROR]), totals
    assert totals["bad_rows"] == len(bad) and totals["rows"] == len(rows)
    assert sum(totals["opted_out"].values()) == counted[OPTED_OUT] > 0
    return dict(counted)


def samples(out: Path, output_format: str) -> dict[str, tuple[bytes, str | None]]:
    """key -> (image bytes, caption) of every sample written, each key at most once."""
    found: dict[str, tuple[bytes, str | None]] = {}
    if output_format == "webdataset":
        members: Counter[str] = Counter()
        for path in sorted(out.glob("*.tar")):
            with tarfile.open(path) as tar:
                contents = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
            members.update(contents.keys())
            for name, data in contents.items():
                if name.endswith(".jpg"):
                    key = name[:-4]
                    found[key] = (data, contents[f"{key}.txt"].decode())
                    assert json.loads(contents[f"{key}.json"])["key"] == key
        assert not [m for m, n in members.items() if n > 1], "a sample written twice"
    else:
        for path in sorted(out.glob("[0-9]*.parquet")):
            for row in pq.read_table(path, columns=["key", "caption", "jpg"]).to_pylist():
                if row["jpg"] is not None:
                    assert row["key"] not in found, "a sample written twice"
                    found[row["key"]] = (row["jpg"], row["caption"])
    return found


def assert_polite(world: World) -> None:
    """Each site saw at most floor(ceiling) + 1 image requests in any second, at the most capacity
    discovery may grant it above what its count of URLs in the list earns, all with our User-Agent
    and the token; robots.txt once per origin a run."""
    count = Counter(site_of_host(row["host"]) for row in world.planned if "invalid" not in row)
    too_busy = []
    for name, site in world.web.sites.items():
        peak, _ = busiest_second(sorted(r.time for r in fetches(site.log)))
        if peak > allowed_per_second(max(rate_for_size(count[name]), DISCOVERY_CEILING)):
            too_busy.append((name, peak))
        assert {r.user_agent for r in site.log} <= {f"{DEFAULT_USER_AGENT} {TOKEN}"}
    assert not too_busy, f"sites that saw more than floor(rate) + 1 requests in a second: {too_busy[:5]}"
    assert not fetches(world.web.sites[world.specs[0].name].log), \
        "a request robots.txt forbids"


def crawl_stopped_then_resumed(tmp: Path, sites: int, rows: int, output_format: str, timeout: float,
                               signum: int, at: float) -> None:
    """Run the command, send ``signum`` once the sites have seen ``at`` of the image requests,
    check nothing it started is left, run it again to the end and check the dataset."""
    world = World(tmp, sites, rows)
    out = tmp / "dataset"
    marker = uuid.uuid4().hex
    with world.web.serving():
        world.write_list()
        env = command_env(tmp, world, marker)
        argv = command(world, out, output_format)
        first = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        images = sum(1 for row in world.planned if row.get("expect") in (SUCCESS, ERROR, LINK_ROT))
        deadline = time.monotonic() + timeout
        while image_requests(world.web) < images * at:
            assert first.poll() is None, first.stdout.read().decode()[-3000:]  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the first run did not get far enough"
            time.sleep(0.2)
        first.send_signal(signum)
        code = first.wait(60)
        said = first.stdout.read().decode()  # type: ignore[union-attr]
        if signum != signal.SIGKILL:  # a stop it could see: everything stopped in order, exit 130
            assert code == 130 and "run the same command again" in said, (code, said[-3000:])
        assert_none_left(marker)  # a SIGKILLed command takes its stack, monitor and workers with it too
        before = image_requests(world.web)
        started = time.monotonic()
        second = run_to_the_end(argv, env, timeout)
        print(f"\n[crawl e2e] {rows} rows, {sites} sites, {output_format}: {signal.Signals(signum).name} after "
              f"{before} requests, resumed in {time.monotonic() - started:.0f} s with "
              f"{image_requests(world.web) - before} more")
        assert_none_left(marker)
        # The rerun crawled only what had no outcome: not the whole list again. (What the sites
        # had answered but the workers not yet analysed at the kill, ~4 s of fetches, is crawled again.)
        assert image_requests(world.web) - before <= len(world.accepted()) - 0.5 * before
        counted = check_dataset(world, out, output_format)
        assert_polite(world)
    assert "successes" in second.stdout and "warning: --thread_count" in second.stderr, second.stdout
    print(f"[crawl e2e] {counted}")


def test_webdataset_killed_halfway_and_run_again_writes_every_row_once(tmp_path: Path) -> None:
    crawl_stopped_then_resumed(tmp_path, sites=40, rows=1_000, output_format="webdataset", timeout=240,
                               signum=signal.SIGKILL, at=0.4)


def test_parquet_stopped_by_sigterm_stops_all_it_started_and_resumes(tmp_path: Path) -> None:
    crawl_stopped_then_resumed(tmp_path, sites=40, rows=1_000, output_format="parquet", timeout=240,
                               signum=signal.SIGTERM, at=0.2)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_issue_s_10000_rows_over_300_sites_in_webdataset_killed_and_resumed(tmp_path: Path) -> None:
    crawl_stopped_then_resumed(tmp_path, sites=300, rows=10_000, output_format="webdataset", timeout=900,
                               signum=signal.SIGKILL, at=0.5)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_issue_s_10000_rows_over_300_sites_in_parquet_interrupted_by_sigint(tmp_path: Path) -> None:
    crawl_stopped_then_resumed(tmp_path, sites=300, rows=10_000, output_format="parquet", timeout=900,
                               signum=signal.SIGINT, at=0.5)


def test_with_a_fleet_s_settings_it_starts_nothing_and_collects_what_the_fleet_crawls(
        crawl_env: dict[str, str], tmp_path: Path) -> None:  # noqa: F811
    """KAFKA_HOSTS, REDIS_URL and S3 set: the monitor and workers are the test's (a fleet's), the
    command only produces and collects."""
    world = World(tmp_path, sites=10, rows=200)
    out = tmp_path / "dataset"
    marker = uuid.uuid4().hex
    sources = tmp_path / "sources.json"
    sources.write_text("[]")
    with world.web.serving():
        world.write_list()
        fleet_env = {**crawl_env, HOSTS_FILE_ENV: str(world.hosts_file), "SOURCES_URL": str(sources),
                     "TARGET_RESOLUTION": str(IMAGE_SIZE), "CRAWL_USER_AGENT": f"{DEFAULT_USER_AGENT} {TOKEN}",
                     "MONITOR_PORT": "0", "PYTHONUNBUFFERED": "1", "DISCOVERY_MAX_RATE": str(DISCOVERY_CEILING)}
        with Cluster(fleet_env, tmp_path / "fleet") as cluster:
            cluster.start_monitor()
            for n in range(2):
                cluster.children.append(Child(f"worker-{n + 1}", module_argv("test.resolving_worker"), fleet_env,
                                              tmp_path / "fleet" / f"worker-{n + 1}.log").start())
            done = run_to_the_end(command(world, out, "webdataset"), {**fleet_env, "CRAWL_E2E_MARKER": marker},
                                  timeout=240)
            assert not cluster.died()
        assert_none_left(marker)
        assert not (out / "_crawl" / "stack").exists() and "with a fleet" in done.stderr
        check_dataset(world, out, "webdataset")
        assert_polite(world)
