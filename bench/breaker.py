"""How often the breaker's temporary halt fires on a site whose answers fail at random.

``python -m bench.breaker [--runs N]``: for each request rate and error share, the share of
simulated crawls halted: over 600 URLs (a 2% or 5% site must not be), and within the first
minute (a 15% site must be). The minute window as the monitor reads it once a second, each URL
counting one error at most (its retry's answer counted only if it succeeds), judged by
``surge_of_errors`` against the old rule (more than 10% among at least 10, each attempt counted).
"""
from __future__ import annotations

import argparse
import random
from collections import deque
from collections.abc import Callable

from crawl_monitor.circuit_breaker import surge_of_errors


def old_rule(statuses: list[str]) -> bool:
    return len(statuses) >= 10 and sum(s == "500" for s in statuses) > 0.10 * len(statuses)


def halted_at(rule: Callable[[list[str]], bool], rate: int, share: float, seconds: int, rng: random.Random,
              retries_once: bool) -> int | None:
    """The second of the first halt, or None: the window holds the last 60 s of statuses."""
    window: deque[tuple[int, str]] = deque()
    for second in range(seconds):
        for _ in range(rate):
            failed = rng.random() < share
            window.append((second, "500" if failed else "200"))
            if failed:
                retry_failed = rng.random() < share
                if retries_once and not retry_failed:
                    window.append((second, "200"))
                elif not retries_once:
                    window.append((second, "500" if retry_failed else "200"))
        while window and window[0][0] <= second - 60:
            window.popleft()
        if rule([status for _, status in window]):
            return second
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    rng = random.Random(41)
    rules = {"new (Wilson, a URL's error once)": (surge_of_errors, True),
             "old (>10% of >=10, every attempt)": (old_rule, False)}
    print(f"{'rule':<36} {'rate':>5} {'2% halted':>10} {'5% halted':>10} {'15% in 60 s':>12}")
    for name, (rule, once) in rules.items():
        for rate in (1, 3, 10, 25):
            shares = []
            for share, seconds in ((0.02, 600 // rate), (0.05, 600 // rate), (0.15, 60)):
                halts = [halted_at(rule, rate, share, seconds, rng, once) for _ in range(args.runs)]
                shares.append(sum(h is not None for h in halts) / args.runs)
            print(f"{name:<36} {rate:>5} {shares[0]:>10.1%} {shares[1]:>10.1%} {shares[2]:>12.1%}")


if __name__ == "__main__":
    main()
