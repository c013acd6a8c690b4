"""A real-shaped list served by the simulated web: its sites, its Parquet list, its hosts file,
and what the sites themselves saw of a crawl (their latency, requests they forbade).

Every site listens on its own loopback address at one fixed port (80 by default:
URLs as a list writes them), so the list and its identifiers exist before anything
serves, and both crawlers read the same file. Host names resolve from a hosts file
only (``test.resolving_worker`` for our workers, ``sitecustomize`` for img2dataset).
"""
from __future__ import annotations

import http.client
import json
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from bench.list_shape import ShapedSite, shape_sites
from demo.outcomes import CRAWL_ERRORS, LINK_ROT, QUALITY
from demo.sample import PHOTOS, _photo, variant
from bench.web_apart import WebApart
from demo.simweb import Planned, SiteSpec, busiest_second, fetches
from url_lists.rows import derived_identifier

ROOT = Path(__file__).resolve().parent.parent
DISTINCT_IMAGES = 120
DEAD_LINK_EVERY = 33         # one URL in this many is a 404 (a removed image)
DISALLOW_ALL = "User-agent: *\nDisallow: /\n"
PROBES = 15                  # sequential requests per fragile site for its unloaded latency
SITECUSTOMIZE = """\
import importlib.util, json, os
_spec = importlib.util.spec_from_file_location("_resolving", {path!r})
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
with open(os.environ["TEST_HOSTS_FILE"]) as _listing:
    _module.answer_from(json.load(_listing))
"""


@dataclass(frozen=True)
class RealWeb:
    """The list's sites (busiest first), what the simulated web serves, and the plan."""

    sites: list[ShapedSite]
    specs: list[SiteSpec]     # the live sites only (dead hosts have no server)
    plan: list[Planned]       # identifier = the list producer's derived one
    urls: list[str]           # the list, in its order
    port: int

    def hosts(self) -> dict[str, str]:
        return {site.host: site.address for site in self.sites}

    def write(self, folder: Path) -> tuple[Path, Path]:
        """The Parquet list (url, caption) and the hosts file, in ``folder``."""
        url_list, hosts_file = folder / "list.parquet", folder / "hosts.json"
        pq.write_table(pa.table({"url": self.urls, "caption": [f"picture {n}" for n in range(len(self.urls))]}),
                       url_list, row_group_size=2_000)
        hosts_file.write_text(json.dumps(self.hosts()))
        return url_list, hosts_file

    @property
    def fragile(self) -> list[ShapedSite]:
        return [site for site in self.sites if site.fragile]

    @property
    def dead_sites(self) -> set[str]:
        return {site.site for site in self.sites if site.dead}

    @property
    def disallowing(self) -> set[str]:
        return {site.site for site in self.sites if site.disallow_all}

    def describe(self) -> str:
        sites, n = self.sites, len(self.urls)
        disallow = [s for s in sites if s.disallow_all]
        return (f"{n} URLs over {len(sites)} sites (the busiest {sites[0].host} holds {sites[0].urls}, "
                f"{sites[0].urls / n:.1%}, with {sites[0].error_rate:.0%} 500s; "
                f"{sum(s.urls == 1 for s in sites)} sites have one URL, {sum(s.urls == 2 for s in sites)} two); "
                f"{len(self.fragile)} fragile; {len(disallow)} forbid all in robots.txt "
                f"({sum(s.urls for s in disallow)} URLs); {sum(s.error_rate == 1 for s in sites)} answer 500 to all; "
                f"{sum(s.dead for s in sites)} dead hosts; 1 URL in {DEAD_LINK_EVERY} a 404")


def build_real_web(urls: int, seed: int = 41, port: int = 80) -> RealWeb:
    rng = random.Random(seed)
    photos = {name: _photo(name) for name in PHOTOS}
    bodies = [variant(rng, photos) for _ in range(DISTINCT_IMAGES)]
    sites = shape_sites(urls, seed)
    specs, plan, listed = [], [], []
    for index, site in enumerate(sites):
        files: dict[str, bytes] = {}
        for k in range(site.urls):
            ext, body = bodies[rng.randrange(len(bodies))]
            path = f"/p/{index}/{k}.{ext}"
            url = f"http://{site.host}{'' if port == 80 else f':{port}'}{path}"
            if site.dead or site.error_rate == 1.0 or site.disallow_all:
                expect = {CRAWL_ERRORS}
            elif (index + k) % DEAD_LINK_EVERY == DEAD_LINK_EVERY - 1:
                expect = {LINK_ROT}
            else:
                expect = {QUALITY} | ({CRAWL_ERRORS} if site.error_rate else set())
                files[path] = body
            plan.append(Planned(derived_identifier(url), site.site, path, frozenset(expect)))
            listed.append(url)
        if not site.dead:
            specs.append(SiteSpec(site.site, 1, files, latency=site.latency, error_rate=site.error_rate,
                                  robots_txt=DISALLOW_ALL if site.disallow_all else None, seed=index,
                                  slots=site.slots, host=site.address, port=port))
    order = list(range(len(listed)))
    rng.shuffle(order)
    return RealWeb(sites, specs, [plan[i] for i in order], [listed[i] for i in order], port)


def write_sitecustomize(folder: Path) -> Path:
    """A folder for PYTHONPATH whose ``sitecustomize`` answers every lookup from the hosts
    file in TEST_HOSTS_FILE (``test.resolving_worker``'s rule), in each process it starts."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(path=str(ROOT / "test" / "resolving_worker.py")))
    return folder


def median_ms(values: list[float]) -> float | None:
    return statistics.median(values) * 1000 if values else None


def unloaded_latency(real: RealWeb) -> dict[str, float | None]:
    """Each fragile site's median latency (ms) as the site measures it, asked one request at a
    time: its own arrival-to-answer time, no queue."""
    by_name = {spec.name: spec for spec in real.specs}
    web = WebApart([by_name[site.site] for site in real.fragile])  # served as in the rounds
    with web.serving():
        for site in real.fragile:
            paths = list(by_name[site.site].files)[:PROBES]
            for path in paths:
                connection = http.client.HTTPConnection(site.address, real.port, timeout=10)
                connection.request("GET", path, headers={"Host": site.host})
                connection.getresponse().read()
                connection.close()
    return {name: median_ms([r.served_in for r in s.log]) for name, s in web.sites.items()}


@dataclass(frozen=True)
class SitesSaw:
    """A crawl as the sites saw it."""

    fragile_ms: dict[str, float | None]  # site -> median latency of its image requests
    disallowed_requests: int             # requests other than robots.txt to sites forbidding all
    busiest_peak: int                    # the busiest site's most requests in one second
    fastest_peak: tuple[str, int]        # the site with the most requests in one second, and that many


def sites_saw(real: RealWeb, web: WebApart) -> SitesSaw:
    fragile = {site.site for site in real.fragile}
    disallowing = real.disallowing
    peaks = {name: busiest_second(sorted(r.time for r in fetches(site.log)))[0]
             for name, site in web.sites.items()}
    fastest = max(peaks.items(), key=lambda item: item[1])
    return SitesSaw(
        {name: median_ms([r.served_in for r in fetches(web.sites[name].log)]) for name in fragile},
        sum(len(fetches(web.sites[name].log)) for name in disallowing),
        peaks[real.sites[0].site], fastest)
