"""The back-off against simulated sites, in simulated time: ``python -m bench.discovery_sim``.

The real ``Adaptation`` (over the test suite's in-memory Redis) looks once a second, as the
monitor does before each regulator tick; its grant reaches the site ``GRANT_DELAY`` later, as
the regulator's write does. A site is the real-shaped bench's (``bench.real_web``): ``slots``
requests served at once, each for ``service`` seconds, the rest queued (none: any rate). Sends
are paced at the grant, at most ``PER_HOST`` in flight (two workers' per-host cap), and while
``--starved`` seconds last only a share of them leaves on time (``--on-time``): the workers are
short of CPU while the crawl's one-URL sites start. Each answer is recorded in its response
bucket ``RECORD_LAG`` after it came. No CPU, no network: a run takes a second, and the same
seeds give the same numbers, so a change to the controller is judged here before the bench.

Prints, over ``--seeds`` runs: when the last of the three tail sites answered (the crawl's end
in the real-shaped bench), each site's time, its median latency over unloaded (median and worst
run), and its highest grant; ``--slow`` runs sites of one slot at 2 to 12 req/s instead, near and
below where a slow start begins (the politeness the tail's speed must not cost).
``--set NAME=VALUE`` changes a constant of ``crawl_monitor.adaptive`` for the run; ``--trace SITE``
prints one run's grant, requests and median latency a second.
"""
from __future__ import annotations

import argparse
import asyncio
import heapq
import random
import statistics
from dataclasses import dataclass, field

import crawl_monitor.adaptive as adaptive
from common import contracts
from common.response_times import bin_of, bucket_start
from test.test_monitor_fakes import FakeAsyncRedis

T0 = 1_000_000.0
STEP = 0.005          # simulated seconds a step
GRANT_DELAY = 0.3     # a verdict reaches the workers' tokens this long after the look
RECORD_LAG = 0.03     # an answer is counted this long after it came
PER_HOST = 16         # two workers x CRAWL_PER_HOST_CONNECTIONS
FIRST_REQUEST = 0.9   # seconds from the first grant to the site's first request (rules fetched first)
LIMIT, CAP = 1.0, 32.0  # a list site's limit and the discovery ceiling (DISCOVERY_MAX_RATE)


@dataclass(frozen=True)
class Site:
    urls: int
    slots: int | None  # None: any number at once
    service: float


SITES = {"musiczone": Site(266, None, 0.181), "craftpics": Site(160, 2, 0.186), "weddingclub": Site(120, 2, 0.229)}
# --slow: sites of one slot and 100 URLs at 2-12 req/s, near and below where a slow start begins.
SLOW_SITES = {f"{rate}-per-s": Site(100, 1, 1 / rate) for rate in (2, 3, 4, 5, 6, 8, 12)}


@dataclass
class Second:
    grant: float
    ttfbs: list[float] = field(default_factory=list)  # of the requests sent in it


@dataclass
class Run:
    last_answer: float
    latency: float  # median at the site over unloaded
    top_grant: float
    seconds: dict[int, Second] = field(default_factory=dict)


async def crawl(name: str, site: Site, seed: int, starved: float, on_time: float) -> Run:
    rnd = random.Random(seed)
    redis = FakeAsyncRedis()
    now = T0
    adaptation = adaptive.Adaptation(redis, clock=lambda: now)
    await adaptation.meet([name])
    grant = adaptation.effective(name, LIMIT, CAP)
    granted: list[tuple[float, float]] = []  # (when it takes effect, rate)
    next_look, next_send, sent = T0 + rnd.uniform(0.5, 1.0), T0 + FIRST_REQUEST, 0
    free_at = [T0] * (site.slots or 0)
    answers: list[tuple[float, float, float]] = []  # (recorded at, time to first byte, answered at)
    served: list[float] = []
    run = Run(0.0, 0.0, grant)
    while sent < site.urls or answers:
        in_flight = sum(1 for answer in answers if answer[2] > now)
        while sent < site.urls and next_send <= now and in_flight < PER_HOST:
            if now - T0 < starved and rnd.random() > on_time:  # a late worker: this send slips
                next_send += 0.3 / grant
                continue
            if site.slots:
                slot = min(range(site.slots), key=free_at.__getitem__)
                free_at[slot] = max(now, free_at[slot]) + site.service
                ttfb = free_at[slot] - now
            else:
                ttfb = site.service
            ttfb += rnd.uniform(0, 0.01)
            served.append(ttfb)
            run.seconds.setdefault(int(now - T0), Second(grant)).ttfbs.append(ttfb)
            heapq.heappush(answers, (now + ttfb + RECORD_LAG, ttfb, now + ttfb))
            sent, in_flight = sent + 1, in_flight + 1
            next_send = max(next_send + 1.0 / grant, now - 0.2)
        while answers and answers[0][0] <= now:
            recorded, ttfb, _ = heapq.heappop(answers)
            redis.store.hincrby(contracts.response_times_key(name, bucket_start(recorded)), str(bin_of(ttfb)), 1)
            redis.store.zadd(contracts.ACTIVE_SOURCES, {name: recorded}, gt=True)
            run.last_answer = recorded - T0
        if now >= next_look:
            await adaptation.update()
            granted.append((now + GRANT_DELAY, adaptation.effective(name, LIMIT, CAP)))
            next_look += 1.0 + rnd.uniform(-0.06, 0.06)  # the monitor's tick, give or take
        while granted and granted[0][0] <= now:
            grant = granted.pop(0)[1]
            run.top_grant = max(run.top_grant, grant)
        now += STEP
    run.latency = statistics.median(served) / site.service
    return run


async def main(args: argparse.Namespace) -> None:
    for setting in args.set:
        name, value = setting.split("=", 1)
        if not hasattr(adaptive, name):
            raise SystemExit(f"crawl_monitor.adaptive has no {name}")
        setattr(adaptive, name, type(getattr(adaptive, name))(value))
    args.slow = args.slow or args.trace in SLOW_SITES
    sites = SLOW_SITES if args.slow else SITES
    runs = {name: [await crawl(name, site, seed, args.starved, args.on_time) for seed in range(args.seeds)]
            for name, site in sites.items()}
    print(f"{args.seeds} runs, {args.starved:.0f} s at {args.on_time:.0%} of sends on time; {' '.join(args.set)}")
    if not args.slow:
        ends = [max(runs[name][seed].last_answer for name in SITES) for seed in range(args.seeds)]
        print(f"the tail's last answer: median {statistics.median(ends):.2f} s, mean {statistics.mean(ends):.2f}, "
              f"worst {max(ends):.1f}")
    for name, site_runs in runs.items():
        latency = [r.latency for r in site_runs]
        print(f"  {name:<12} last answer mean {statistics.mean(r.last_answer for r in site_runs):5.2f} s; latency "
              f"x{statistics.median(latency):.1f} unloaded (worst run x{max(latency):.1f}); "
              f"top grant {max(r.top_grant for r in site_runs):.1f} req/s")
    if args.trace:
        run = runs[args.trace][0]
        seconds = [run.seconds.get(s, Second(0.0)) for s in range(int(run.last_answer) + 1)]
        print("  grant ", " ".join(f"{s.grant:5.1f}" if s.ttfbs else "    -" for s in seconds))
        print("  sent  ", " ".join(f"{len(s.ttfbs):5d}" for s in seconds))
        print("  ms    ", " ".join(f"{statistics.median(s.ttfbs) * 1000:5.0f}" if s.ttfbs else "    -"
                                   for s in seconds))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--starved", type=float, default=6.0, help="seconds the workers are short of CPU")
    parser.add_argument("--on-time", type=float, default=0.6, help="share of sends on time meanwhile")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--slow", action="store_true", help="sites of one slot at 2-12 req/s instead of the tail's")
    parser.add_argument("--trace", choices=sorted([*SITES, *SLOW_SITES]))
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
