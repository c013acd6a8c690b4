"""What the demo leaves in ``out/`` and the summary it prints.

The results are the crawler's real outputs, fetched back the way a
downstream consumer would: thumbnails from S3, metadata from the Kafka
topics. The achieved rates come from the sample site's own request log, so
the summary shows politeness as the website saw it.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Mapping

import botocore.session
import redis

from common.contracts import ADAPTIVE_CEILING_FIELD, CRAWL_ERRORS_TOPIC, adaptive_key, thumbnail_key
from demo.grants import GrantLog
from demo.outcomes import CRAWL_ERRORS, LINK_ROT, OPTED_OUT, QUALITY, Outcomes
from devstack.servers import DEV_CREDENTIALS
from devstack.stack import StackAddresses
from common.contracts import allowed_per_second
from demo.simweb import Planned, SimWeb, busiest_second, fetches, spec_rate

DOWNLOAD_THREADS = 8


def write_topics(outcomes: Outcomes, out_dir: Path) -> list[Path]:
    """Each outcome topic's messages about this crawl, one JSON object a line."""
    paths = []
    for topic, messages in outcomes.messages.items():
        path = out_dir / f"{topic}.jsonl"
        path.write_text("".join(json.dumps(m) + "\n" for m in messages))
        paths.append(path)
    return paths


def download_thumbnails(addresses: StackAddresses, uuids: list[str], folder: Path) -> int:
    """Fetch each success's thumbnail from S3 into ``folder`` under its key (``{uuid}.jpg`` for a
    UUID; one safe file name for any identifier); returns how many were there."""
    folder.mkdir(parents=True, exist_ok=True)
    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=addresses.s3_endpoint_url, **DEV_CREDENTIALS)

    def fetch(uuid: str) -> bool:
        try:
            body = client.get_object(Bucket=addresses.s3_bucket, Key=thumbnail_key(uuid))["Body"].read()
        except client.exceptions.NoSuchKey:
            return False
        (folder / thumbnail_key(uuid)).write_bytes(body)
        return True

    with ThreadPoolExecutor(DOWNLOAD_THREADS) as pool:
        return sum(pool.map(fetch, uuids))


@dataclass(frozen=True)
class SourceRow:
    source: str
    urls: int
    successes: int
    link_rot: int
    errors: int
    requests: int
    mean_rps: float
    peak_rps: int
    allowed: float | None  # the mean grant over the busy span: what the adaptive back-off allowed
    limit: float
    opted_out: int = 0     # URLs the site's consent signals kept out (robots.txt, TDMRep, ...)


def summarize(web: SimWeb, plan: list[Planned], outcomes: Outcomes, redis_url: str,
              grants: GrantLog) -> list[SourceRow]:
    """Per source: outcomes, its achieved rate (mean over its busy span, and the busiest
    one-second window), what the monitor granted meanwhile (``grants``) and its limit (the
    ceiling the adaptive back-off last saved: capacity discovery's for a source that may
    discover; or SPEC.md §3's computed rate)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    rows = []
    for name, site in web.sites.items():
        uuids = [p.uuid for p in plan if p.source.lower() == name]
        kinds = [outcomes.kind_of(u) for u in uuids]
        times = [r.time for r in fetches(site.log)]
        span = max(times) - min(times) if len(times) > 1 else 0.0
        ceiling = client.hget(adaptive_key(name), ADAPTIVE_CEILING_FIELD)
        rows.append(SourceRow(
            name, len(uuids), kinds.count(QUALITY), kinds.count(LINK_ROT), kinds.count(CRAWL_ERRORS),
            len(times), (len(times) - 1) / span if span else 0.0, busiest_second(sorted(times))[0],
            grants.mean(name, min(times), max(times)) if times else None,
            float(ceiling) if ceiling else spec_rate(site.spec.image_count), kinds.count(OPTED_OUT)))
    client.close()
    return rows


def format_table(rows: list[SourceRow]) -> str:
    """``polite``: no sliding second held more than floor(limit) + 1 requests (``allowed_per_second``)."""
    header = (f"{'source':<18}{'urls':>6}{'ok':>6}{'rot':>6}{'errors':>8}{'opt-out':>8}{'requests':>10}"
              f"{'mean req/s':>12}{'peak 1s':>9}{'allowed/s':>11}{'limit/s':>9}{'polite':>8}")
    lines = [header, "-" * len(header)]
    for r in rows:
        polite = "yes" if r.peak_rps <= allowed_per_second(r.limit) else "NO"
        allowed = "-" if r.allowed is None else f"{r.allowed:.2f}"
        lines.append(f"{r.source:<18}{r.urls:>6}{r.successes:>6}{r.link_rot:>6}{r.errors:>8}{r.opted_out:>8}"
                     f"{r.requests:>10}{r.mean_rps:>12.2f}{r.peak_rps:>9}{allowed:>11}{r.limit:>9.2f}{polite:>8}")
    lines.append("allowed/s: the mean rate the adaptive back-off granted while the source was crawled (a new\n"
                 "source starts at a tenth of its limit and doubles each second while its site answers as fast\n"
                 "as at first); a mean req/s well below it means the workers were the bottleneck")
    return "\n".join(lines)


def error_reasons(outcomes: Outcomes) -> Mapping[str, int]:
    reasons: dict[str, int] = {}
    for message in outcomes.messages.get(CRAWL_ERRORS_TOPIC, []):
        reason = str(message.get("reason"))
        reasons[reason] = reasons.get(reason, 0) + 1
    return reasons
