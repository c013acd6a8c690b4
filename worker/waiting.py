"""Where URLs wait for a time (SPEC.md §1): for their host's robots.txt, or parked because
their source cannot take them now.

This module writes the messages; ``worker.wait_line`` reads them. A URL waiting in
a task would hold a slot and, since offsets are committed in order, the commit of
its whole partition, for up to hours; a URL held in the worker's memory would
hold the other sources of its partition behind it (issue 26). So it waits in
Kafka instead: it is produced to a wait topic with its ``not_before`` (when it may
go) and committed, and the wait line, one more consumer in each worker, hands it
back to ``urls`` once due.

Kafka cannot deliver a message later, so each wait topic holds waits of one
length (30 s, 5 min, 1 h; a longer wait takes several turns): its messages
fall due in the order they were written, and a partition whose first
message is not yet due is paused until it is. Nothing is committed before
it has been handed on, so a crash or a rebalance repeats a hand-over, never
loses one; what the line holds in memory is at most one poll's batch.
"""
from __future__ import annotations

import json

from common.contracts import WAIT_TOPICS, CrawlRequest
from worker.constants import WAIT_TIER_SECONDS


def wait_message(request: CrawlRequest, not_before: float, now: float) -> tuple[str, bytes]:
    """The wait topic and message for ``request`` to come back at ``not_before``: its next turn."""
    remaining = not_before - now
    tier = 0
    for i, seconds in enumerate(WAIT_TIER_SECONDS):
        if remaining >= seconds:
            tier = i
    # A turn of the shortest line may end early (when it is due); longer ones last their length,
    # so each topic's messages fall due in the order they were written.
    length = WAIT_TIER_SECONDS[tier]
    due = now + (min(max(remaining, 0.0), length) if tier == 0 else length)
    return WAIT_TOPICS[tier], request.to_json(not_before=not_before, due=due)


def wait_times(value: bytes | None) -> tuple[float, float]:
    """(due, not_before) of a wait message; a damaged one is due now (and rejected on hand-over)."""
    try:
        data = json.loads(value or b"")
        return float(data["due"]), float(data["not_before"])
    except (ValueError, TypeError, KeyError):
        return 0.0, 0.0
