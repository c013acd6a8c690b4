"""The per-URL cost of consent: ``python -m bench.consent [--urls N]``.

Each check a worker makes for every URL, against rules already in its memory (a cache hit:
the per-origin files are fetched once a day), timed side by side in one run:

- robots.txt for our token alone (the check before issue 45) and with two extra tokens and
  Content-Usage rules;
- tdmrep.json with 3 rules (a real file's size) and with 1,000 (a hostile one, within the
  64 KiB bound);
- a response head with no consent header, and with X-Robots-Tag, tdm-reservation and
  Content-Usage headers to judge;
- the whole check of the cached robots.txt and tdmrep.json (async, as the gate's
  ``before_request`` makes it), against robots.txt's as it was before issue 45 (our token alone).

Also the memory a parsed tdmrep.json of 1,000 rules holds (tracemalloc) beside the estimate
its cache is bounded by. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
import tracemalloc
from collections.abc import Callable

from multidict import CIMultiDict

from worker.politeness.consent import ResponseConsent
from worker.politeness.robots import RULES, RobotsCache, RobotsFile, Rules, origin_of
from worker.politeness.robots_group import groups_for
from worker.politeness.tdmrep import TdmRepCache, TdmRules, condensed_rules

TOKEN = "cc-image-crawler"
EXTRA = ("CCBot", "img2dataset")
ORIGIN = "https://photos.example.org"
ROBOTS = """User-agent: *
Disallow: /private/
Disallow: /tmp/
Allow: /private/public/
Content-Usage: train-ai=n
Content-Usage: /open/ train-ai=y

User-agent: CCBot
Disallow: /ccbot-out/

User-agent: img2dataset
Disallow: /no-datasets/
Content-Usage: /archive/ train-ai=n
"""
TDMREP_SMALL = [{"location": "/photos/*", "tdm-reservation": 1, "tdm-policy": "https://example.org/p"},
                {"location": "/open/", "tdm-reservation": 0}, {"location": "/*.tif$", "tdm-reservation": 1}]
TDMREP_LARGE = [{"location": f"/collection-{i}/*/large-*.jpg", "tdm-reservation": i % 2} for i in range(1000)]


def urls(n: int) -> list[str]:
    folders = ("open", "photos", "private/public", "gallery/2024", "archive", "img")
    return [f"{ORIGIN}/{folders[i % len(folders)]}/{i}/image-{i}.jpg?w={i % 7}" for i in range(n)]


def micros(check: Callable[[str], object], sample: list[str], rounds: int = 5) -> float:
    """Best of ``rounds`` passes over ``sample``: µs per call."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for url in sample:
            check(url)
        best = min(best, time.perf_counter() - started)
    return round(best / len(sample) * 1e6, 3)


def robots_file(tokens: tuple[str, ...]) -> RobotsFile:
    groups = groups_for(ROBOTS, (TOKEN, *tokens))
    return RobotsFile(RULES, groups[TOKEN], 200, groups={t: groups[t] for t in tokens}, tokens=[TOKEN, *tokens])


def tdm_rules(rules: list[dict]) -> TdmRules:
    return TdmRules(RobotsFile(RULES, condensed_rules(json.dumps(rules)) or "", 200))


def heads(**headers: str) -> CIMultiDict:
    return CIMultiDict({k.replace("_", "-"): v for k, v in headers.items()})


class _Stored:
    """A Redis stand-in that answers one stored record per key: the caches are measured on hits."""

    def __init__(self, records: dict[str, str]):
        self.records = records

    async def get(self, key: str) -> str | None:
        return self.records.get(key)


async def gate_micros(sample: list[str], with_tdmrep: bool, extra: tuple[str, ...] = EXTRA) -> float:
    categories = ("train-ai",) if extra else ()
    robots_cache = RobotsCache(_Stored({f"robots:{ORIGIN}": robots_file(extra).to_json()}), None, TOKEN,  # type: ignore[arg-type]
                               extra_tokens=extra, categories=categories)
    tdm_record = RobotsFile(RULES, condensed_rules(json.dumps(TDMREP_SMALL)) or "", 200).to_json()
    tdm_cache = TdmRepCache(_Stored({f"tdmrep:{ORIGIN}": tdm_record}), None, TOKEN)  # type: ignore[arg-type]

    async def check(url: str) -> None:
        origin = origin_of(url)  # once per URL, as the gate does
        for cache in (robots_cache, tdm_cache) if with_tdmrep else (robots_cache,):
            try:
                await cache.check(url, origin)
            except Exception:  # noqa: BLE001 - a refusal is a result here
                pass

    await check(sample[0])  # loads both into memory
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for url in sample:
            await check(url)
        best = min(best, time.perf_counter() - started)
    return round(best / len(sample) * 1e6, 3)


def parsed_bytes(rules: list[dict]) -> tuple[int, int]:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    parsed = tdm_rules(rules)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return held, parsed.size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--urls", type=int, default=20_000)
    args = parser.parse_args()
    sample = urls(args.urls)
    ours = Rules(robots_file(()), TOKEN)
    every = Rules(robots_file(EXTRA), TOKEN, EXTRA, ("train-ai",))
    small, large = tdm_rules(TDMREP_SMALL), tdm_rules(TDMREP_LARGE)
    consent = ResponseConsent(tokens=(TOKEN, *EXTRA))
    plain = heads(Content_Type="image/jpeg", Content_Length="123456", Cache_Control="max-age=3600")
    signalled = heads(Content_Type="image/jpeg", X_Robots_Tag="noindex, nofollow", tdm_reservation="0",
                      Content_Usage="search=y, train-ai=y")
    results = {
        "urls": len(sample),
        "robots_our_token_us": micros(ours.refusal, sample),
        "robots_3_tokens_and_content_usage_us": micros(every.refusal, sample),
        "tdmrep_3_rules_us": micros(small.refusal, sample),
        "tdmrep_1000_rules_us": micros(large.refusal, sample),
        "head_without_signals_us": micros(lambda _u: consent.refusal(plain), sample),
        "head_with_three_signals_us": micros(lambda _u: consent.refusal(signalled), sample),
        "before_request_as_before_issue_45_us": asyncio.run(gate_micros(sample, False, ())),
        "before_request_robots_only_us": asyncio.run(gate_micros(sample, False)),
        "before_request_robots_and_tdmrep_us": asyncio.run(gate_micros(sample, True)),
    }
    results["before_request_ratio_new_vs_old"] = round(
        results["before_request_robots_and_tdmrep_us"] / results["before_request_as_before_issue_45_us"], 2)
    results["robots_cost_ratio_new_vs_old"] = round(
        results["robots_3_tokens_and_content_usage_us"] / results["robots_our_token_us"], 2)
    for name, rules in (("3", TDMREP_SMALL), ("1000", TDMREP_LARGE)):
        held, estimate = parsed_bytes(rules)
        results[f"tdmrep_{name}_rules_parsed_bytes"] = held
        results[f"tdmrep_{name}_rules_estimate_bytes"] = estimate
    print(json.dumps(results))


if __name__ == "__main__":
    main()
