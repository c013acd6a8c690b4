"""How often the breaker's temporary halt fires on a site whose answers fail at random.

``python -m bench.breaker [--runs N]``: for each request rate and error share, the share of
simulated crawls halted: over 600 URLs (a 2% or 5% site must not be), within the first minute and
the first two (a 15% site must be), and the median second a 50% site is halted at. The minute
window as the monitor reads it once a second (the last 60 s of answers, judged after each second),
each URL counting one error at most (its retry's answer counted only if it succeeds), judged by
``error_surge`` beside the rules it replaced: the Wilson score lower bound of the share above 10%
among at least 20, and more than 10% among at least 10 with every attempt counted. Every rule
sees the same simulated crawls.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
from collections import deque
from collections.abc import Callable

from crawl_monitor.circuit_breaker import error_surge

Rule = Callable[[int, int], bool]
RATES = (1, 2, 5, 10, 25)


def old_rule(errors: int, total: int) -> bool:
    return total >= 10 and errors > 0.10 * total


def wilson_rule(errors: int, total: int, z: float = 1.645) -> bool:
    if total < 20:
        return False
    share = errors / total
    spread = z * math.sqrt(share * (1 - share) / total + z * z / (4 * total * total))
    return (share + z * z / (2 * total) - spread) / (1 + z * z / total) > 0.10


def halted_at(rule: Rule, rate: int, share: float, seconds: int, rng: random.Random, retries_once: bool) -> int | None:
    """The second of the first halt (0: after the first second), or None."""
    window: deque[tuple[int, int]] = deque()  # (errors, answers) of each of the last 60 seconds
    errors = answers = 0
    for _second in range(seconds):
        second_errors = second_answers = 0
        for _ in range(rate):
            second_answers += 1
            if rng.random() < share:
                second_errors += 1
                retry_failed = rng.random() < share
                if not retries_once:  # every attempt counted
                    second_answers += 1
                    second_errors += retry_failed
                elif not retry_failed:  # a URL's error once: its retry counted only if it succeeds
                    second_answers += 1
        window.append((second_errors, second_answers))
        errors, answers = errors + second_errors, answers + second_answers
        if len(window) > 60:
            gone_errors, gone_answers = window.popleft()
            errors, answers = errors - gone_errors, answers - gone_answers
        if rule(errors, answers):
            return _second
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    args = parser.parse_args()
    rules: dict[str, tuple[Rule, bool]] = {
        "new (>10% and tail vs 3% < 0.002)": (error_surge, True),
        "Wilson (lower bound > 10%, >=20)": (wilson_rule, True),
        "old (>10% of >=10, every attempt)": (old_rule, False)}
    print(f"{args.runs} runs a cell; the same crawls for every rule", flush=True)
    print(f"{'rule':<36} {'req/s':>5} {'2% halted':>10} {'5% halted':>10} {'15% in 60 s':>12} "
          f"{'15% in 120 s':>13} {'50%: median s':>14}")
    for name, (rule, once) in rules.items():
        for rate in RATES:
            two, five = (_runs(rule, once, rate, share, 600 // rate, args.runs) for share in (0.02, 0.05))
            fifteen, fifty = _runs(rule, once, rate, 0.15, 120, args.runs), _runs(rule, once, rate, 0.5, 60, args.runs)
            in_minute = [h if h is not None and h < 60 else None for h in fifteen]
            print(f"{name:<36} {rate:>5} {_halted(two):>10.2%} {_halted(five):>10.1%} {_halted(in_minute):>12.1%} "
                  f"{_halted(fifteen):>13.1%} {statistics.median(60 if h is None else h + 1 for h in fifty):>14}",
                  flush=True)


def _runs(rule: Rule, once: bool, rate: int, share: float, seconds: int, runs: int) -> list[int | None]:
    """Run ``run`` of a cell draws the same answers whichever the rule."""
    return [halted_at(rule, rate, share, seconds, random.Random(f"{rate} {share} {run}"), once) for run in range(runs)]


def _halted(halts: list[int | None]) -> float:
    return sum(h is not None for h in halts) / len(halts)


if __name__ == "__main__":
    main()
