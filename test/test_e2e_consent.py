"""Consent on the real stack: a monitor and three workers crawl simulated sites, one per
signal, each also serving URLs its rules leave open.

The verdict comes from the output topics (every URL ends in the outcome its signals call for,
with the signal that decided), from Redis's counters, and from the sites' own logs: no request
for a URL a file-level rule reserves, one tdmrep.json fetch per origin for three workers, and for
an opt-out in a response's head only a small part of a multi-megabyte image sent.
"""
from __future__ import annotations

import io
import json
import uuid as uuidlib
from collections import Counter
from pathlib import Path

import numpy as np
import redis
from PIL import Image

from common.contracts import (OPTED_OUT_TOPIC, SIGNAL_CONTENT_USAGE_HEADER, SIGNAL_ROBOTS,
                              SIGNAL_ROBOTS_CONTENT_USAGE, SIGNAL_ROBOTS_EXTRA, SIGNAL_TDMREP_FILE,
                              SIGNAL_TDMREP_HEADER, SIGNAL_X_ROBOTS_TAG, opted_out_key)
from demo.crawl import crawl
from demo.outcomes import OPTED_OUT, QUALITY
from demo.simweb import TDMREP_PATH, Planned, SimWeb, SiteSpec, image_count_for_rate, synthetic_image
from test.test_e2e_crawl import assert_outcomes, assert_polite, crawl_env, fail_if_dead  # noqa: F401
from test.test_e2e_crawl import outcome_report

WORKERS = 3
TIMEOUT = 150.0
URLS = 4  # per site: this many open, and as many reserved
OPEN, RESERVED = "/img/", "/no/"
TDMREP = json.dumps([{"location": "/no/*", "tdm-reservation": 1, "tdm-policy": "https://example.org/tdm"},
                     {"location": "/", "tdm-reservation": 0}])
# name -> (robots.txt, tdmrep.json, headers of the reserved paths, headers of every path, signal)
SITES = {
    "ours": ("User-agent: cc-image-crawler\nDisallow: /no/\n", None, {}, {}, SIGNAL_ROBOTS),
    "extra": ("User-agent: CCBot\nDisallow: /no/\n\nUser-agent: *\nAllow: /\n", None, {}, {},
              SIGNAL_ROBOTS_EXTRA),
    "usage": ("User-agent: *\nAllow: /\nContent-Usage: /no/ train-ai=n\nContent-Usage: search=y\n", None, {}, {},
              SIGNAL_ROBOTS_CONTENT_USAGE),
    "tdmfile": (None, TDMREP, {}, {}, SIGNAL_TDMREP_FILE),
    "tdmhead": (None, None, {"tdm-reservation": "1"}, {}, SIGNAL_TDMREP_HEADER),
    "xrtall": (None, None, {"X-Robots-Tag": "noai"}, {}, SIGNAL_X_ROBOTS_TAG),
    "usagehead": (None, None, {"Content-Usage": "train-ai=n"}, {}, SIGNAL_CONTENT_USAGE_HEADER),
    "xrtother": (None, None, {}, {"X-Robots-Tag": "otherbot: noai, noimageai"}, None),
}
FILE_LEVEL = {SIGNAL_ROBOTS, SIGNAL_ROBOTS_EXTRA, SIGNAL_ROBOTS_CONTENT_USAGE, SIGNAL_TDMREP_FILE}
# Hostile sites, each with its open and reserved URLs: name -> (tdmrep.json, its redirects, headers of
# every path, the signal every URL of the site ends by, None: crawled as if nothing were said).
HOSTILE = {
    "tdmhuge": ("[" + " " * (600 * 1024) + "]", {}, {}, SIGNAL_TDMREP_FILE),  # past 512 KiB: all reserved
    "tdmnested": ("[" * 50_000 + "]" * 50_000, {}, {}, None),
    "tdmnotjson": ("<html><body>Soft 404</body></html>", {}, {}, None),
    "tdmloop": (None, {TDMREP_PATH: "/loop", "/loop": TDMREP_PATH}, {}, None),
    "bigheader": (None, {}, {"X-Robots-Tag": "x" * 30_000 + ", noai"}, SIGNAL_X_ROBOTS_TAG),
    "badheaders": (None, {}, {"X-Robots-Tag": ":::,,,;" * 500, "tdm-reservation": "1;" + "~" * 3_000,
                              "Content-Usage": "train-ai=" + "(" * 5_000}, None),
}


def big_jpeg(megapixels: float = 7.0) -> bytes:
    """A photo-sized JPEG of noise: several megabytes that do not compress."""
    side = int((megapixels * 1e6) ** 0.5)
    pixels = np.random.default_rng(45).integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


def consent_web(prefix: str, log_dir: Path, big: bytes) -> tuple[SimWeb, list[Planned]]:
    specs, plan = [], []
    for i, (name, (robots, tdmrep, reserved_headers, all_headers, signal)) in enumerate(SITES.items()):
        source = f"{prefix}{name}"
        files: dict[str, bytes] = {}
        for k in range(URLS):
            ext, body, _ = synthetic_image((i * URLS + k) % 48)
            files[f"{OPEN}{k}.{ext}"] = body
            plan.append(Planned(str(uuidlib.uuid4()), source, f"{OPEN}{k}.{ext}", frozenset({QUALITY})))
            reserved = f"{RESERVED}{k}.jpg"
            files[reserved] = big  # served if asked: only the crawler's consent keeps it out
            plan.append(Planned(str(uuidlib.uuid4()), source, reserved,
                                frozenset({OPTED_OUT if signal else QUALITY})))
        path_headers = {"/": all_headers, RESERVED: {**all_headers, **reserved_headers}}
        specs.append(SiteSpec(source, image_count_for_rate(8), files, latency=0.01, robots_txt=robots,
                              host=f"127.0.45.{i + 1}", tdmrep_json=tdmrep, path_headers=path_headers))
    for i, (name, (tdmrep, redirects, headers, signal)) in enumerate(HOSTILE.items()):
        source = f"{prefix}{name}"
        files = {}
        for k in range(URLS):
            ext, body, _ = synthetic_image((i * URLS + k) % 48)
            files[f"{OPEN}{k}.{ext}"] = body
            plan.append(Planned(str(uuidlib.uuid4()), source, f"{OPEN}{k}.{ext}",
                                frozenset({OPTED_OUT if signal else QUALITY})))
        specs.append(SiteSpec(source, image_count_for_rate(8), files, latency=0.01, host=f"127.0.46.{i + 1}",
                              tdmrep_json=tdmrep, redirects=redirects, path_headers={"/": headers}))
    return SimWeb(specs, log_path=log_dir / "requests.jsonl"), plan


def test_every_signal_decides_before_the_download_and_is_recorded(crawl_env, tmp_path: Path, unique: str) -> None:
    big = big_jpeg()
    assert len(big) > 6_000_000
    prefix = f"c{unique[:6]}"
    web, plan = consent_web(prefix, tmp_path, big)
    with crawl(web, plan, crawl_env, tmp_path, WORKERS, ROBOTS_EXTRA_TOKENS="CCBot") as (cluster, outcomes):
        assert outcomes.wait(TIMEOUT, fail_if_dead(cluster)), outcome_report(outcomes, plan)
    assert_outcomes(outcomes, plan)
    assert_polite(web, WORKERS)

    by_uuid = {p.uuid: p for p in plan}
    decided = {m["identifier"]: m for m in outcomes.messages[OPTED_OUT_TOPIC]}
    for name, (*_, signal) in SITES.items():
        source = f"{prefix}{name}"
        site = web.sites[source]
        mine = [m for u, m in decided.items() if by_uuid[u].source == source]
        assert {m["signal"] for m in mine} == ({signal} if signal else set()), (name, mine[:2])
        assert all(m["value"] and m["url"].startswith(site.base_url + RESERVED) for m in mine), mine[:2]
        reserved_requests = site.requests(RESERVED)
        if signal in FILE_LEVEL:
            assert reserved_requests == [], f"{name}: {len(reserved_requests)} requests for reserved URLs"
            assert all(m["status"] is None for m in mine)
        elif signal is not None:  # the head opted out: the body was not read
            assert len(reserved_requests) == URLS
            # The worker reads at most 128 KiB past the head; the rest of what the site counts is
            # what the worker's kernel acknowledged into its receive buffer before the close: up
            # to 2.3 MB of the 8 MB seen when the worker was busy. Half of the image tells the two apart.
            sent = [r.sent_bytes for r in reserved_requests]
            assert all(s is not None and s < len(big) // 2 for s in sent), (name, sent, len(big))
            assert all(m["status"] == 200 for m in mine)
        else:
            sizes = [m["filesize"] for m in outcomes.messages["image_metadata_updates"]
                     if "width" in m and by_uuid[m["identifier"]].path.startswith(RESERVED)
                     and by_uuid[m["identifier"]].source == source]
            assert sizes == [len(big)] * URLS, (name, sizes)  # crawled as before: the whole image
        assert len(site.requests(TDMREP_PATH)) == 1, f"{name}: tdmrep.json fetched {len(site.requests(TDMREP_PATH))}x"
        assert len(site.requests(OPEN)) == URLS

    for name, (_, redirects, _, signal) in HOSTILE.items():  # a clear decision, never a crash or a stop
        site = web.sites[f"{prefix}{name}"]
        mine = [m for u, m in decided.items() if by_uuid[u].source == site.spec.name]
        assert {m["signal"] for m in mine} == ({signal} if signal else set()), (name, mine[:2])
        assert len(site.requests(OPEN)) == (0 if signal in FILE_LEVEL else URLS), name
        assert len(site.requests(TDMREP_PATH)) == (3 if redirects else 1), name  # a loop: 6 hops, 3 of them here

    client = redis.Redis.from_url(crawl_env["REDIS_URL"], decode_responses=True)
    for name, (*_, signal) in SITES.items():
        counted = client.hgetall(opted_out_key(f"{prefix}{name}"))
        assert counted == ({signal: str(URLS)} if signal else {}), (name, counted)
    kinds = Counter(outcomes.kind_of(p.uuid) for p in plan)
    head_sites = [f"{prefix}{name}" for name, (*_, signal) in SITES.items() if signal and signal not in FILE_LEVEL]
    acked = sorted(r.sent_bytes or 0 for name in head_sites for r in web.sites[name].requests(RESERVED))
    print(f"\n[consent] outcomes {dict(kinds)}; bytes acknowledged for head opt-outs: {acked} of {len(big)}")
