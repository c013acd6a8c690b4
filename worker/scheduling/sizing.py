"""How much of a source a worker holds and how fast it drains: pure functions of the source's facts.

A queue holds its partition's commit at its oldest URL, and everything finished above it
(parks included) is read again after a rebalance or a crash, so a source's queue holds
QUEUE_SECONDS of what it drains at, and the rest of its URLs are parked
(docs/decisions.md, "One keyed urls topic, and parking").
"""
from __future__ import annotations

from worker.constants import (HEAD_START_MAX_SECONDS, MIN_TASKS_PER_SOURCE, QUEUE_MAX_PER_SOURCE, QUEUE_SECONDS,
                              QUEUE_UNRATED, THROUGHPUT_SMOOTHING)


def pace(rate: float | None, slow_start_limit: float | None) -> float:
    """The rate a source's slots, queue and parked URLs are sized by: its grant, or its limit
    while it slow-starts (the grant climbs there within seconds; the tokens keep the site's rate)."""
    return max(rate or 0.0, slow_start_limit or 0.0)


def drain_rate(pace: float, achieved: float | None, running: int, latency: float) -> float:
    """What a source's queue drains at: its pace, or twice what it achieves here if less (a site's
    connection cap, a busy worker), but not below twice what its running tasks sustain
    (running / latency: Little's law) nor below 1 req/s."""
    if achieved is None:
        return pace
    sustained = running / max(latency, 1e-3)
    return min(pace, max(2 * max(achieved, sustained), 1.0))


def queue_limit(known: bool, drain: float, reserved: int) -> int:
    """URLs of a source queued here before the next are parked: QUEUE_SECONDS of its drain rate
    (or twice its slots, if more), at most QUEUE_MAX_PER_SOURCE; QUEUE_UNRATED while its rate or
    the monitor's judgment of it is not ``known``: no reason to park yet."""
    if not known:
        return QUEUE_UNRATED
    by_slots = 2 * max(reserved, MIN_TASKS_PER_SOURCE)
    by_rate = int(drain * QUEUE_SECONDS)
    return min(max(by_slots, by_rate), QUEUE_MAX_PER_SOURCE)


def head_start(queued: int, pace: float) -> float:
    """Seconds a source's image may go ahead of others waiting for the pool: what its queue here
    needs at its pace (a big site's backlog, not a one-URL site's), at most HEAD_START_MAX_SECONDS."""
    if not pace > 0:
        return 0.0
    return min(queued / pace, HEAD_START_MAX_SECONDS)


def smoothed(previous: float, sample: float, weight: float) -> float:
    """An exponential moving average's next value."""
    return previous + weight * (sample - previous)


def throughput(previous: float | None, ended: int, elapsed: float, running: int, ran_dry: bool) -> float | None:
    """A source's URLs ended here per second after an interval of ``elapsed`` s with work
    throughout: None if its queue ran dry (it shows what came, not what it can do); the
    previous value if none of its URLs ran (held by this worker's slots, not by its site)."""
    if ran_dry:
        return None
    if not ended and not running:
        return previous
    observed = ended / elapsed
    return smoothed(observed if previous is None else previous, observed, THROUGHPUT_SMOOTHING)
