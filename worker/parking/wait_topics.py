"""Where and until when a URL waits in Kafka (SPEC.md §1): for its host's robots.txt, or parked
because its source cannot take it now (``next_turn``).

This module writes the messages; ``worker.parking.hand_back_when_due`` reads them. A URL waiting in
a task would hold a slot and, since offsets are committed in order, the commit of
its whole partition, for up to hours; a URL held in the worker's memory would
hold the other sources of its partition behind it. So it waits in
Kafka instead: it is produced to a wait topic with its ``not_before`` (when it may
go) and committed, and the wait line, one more consumer in each worker, hands it
back to ``urls`` once due.

Kafka cannot deliver a message later, so each wait topic holds waits of one
length (30 s, 5 min, 1 h; a longer wait takes several turns): its messages
fall due about in the order they were written (a turn of the 30 s line ends at its
URL's time when that is under 60 s away, so the line holds up to WAIT_HELD_PER_PARTITION records of a
partition and hands over whichever is due). Nothing is committed before it
has been handed on, so a crash or a rebalance repeats a hand-over, never
loses one.
"""
from __future__ import annotations

import json
from typing import Any

from common.contracts import WAIT_TOPICS, CrawlRequest
from worker.constants import (PARK_DEFAULT_SECONDS, PARK_RETURN_LEAD_SECONDS, PARK_TRUST_SECONDS, PARK_UNJUDGED_SECONDS,
                              WAIT_TIER_SECONDS)


def next_turn(now: float, rate: float, pace: float, queued: int, last_turn: float, *, rate_known: bool,
              judged: bool, temp_halted: bool) -> tuple[float, bool]:
    """When a URL its source cannot take now comes back (wall clock), and whether that is the
    source's latest turn, after which the next URL it parks is placed.

    ``rate``: what its queue drains at (its pace while it slow-starts). A paused (rate 0) or
    temporarily halted source's URL waits PARK_DEFAULT_SECONDS; one of a source the monitor has
    not judged yet PARK_UNJUDGED_SECONDS, and is placed by its pace then. Otherwise URLs are
    spaced 1/rate apart from the end of its ``queued`` ones, and a source held below its
    ``pace`` is placed no further than PARK_TRUST_SECONDS ahead: what it achieved in the last
    seconds says little about minutes ahead."""
    if temp_halted or (rate <= 0 and rate_known):
        return now + PARK_DEFAULT_SECONDS, False
    if rate <= 0 or not judged:
        return now + PARK_UNJUDGED_SECONDS, False
    not_before = max(last_turn, now + queued / rate) + 1.0 / rate
    if rate < pace and not_before > now + PARK_TRUST_SECONDS:
        return now + PARK_TRUST_SECONDS, False
    return not_before, True


def ahead_of_turn(turn: float, now: float) -> float:
    """The ``not_before`` a URL whose turn is ``turn`` is written with: PARK_RETURN_LEAD_SECONDS
    earlier (never before ``now``), so that its way back into a queue (the wait line's poll, the
    read of ``urls``) ends before its turn, not after it."""
    return max(now, turn - PARK_RETURN_LEAD_SECONDS)


def wait_message(request: CrawlRequest, not_before: float, now: float,
                 partition: int | None = None) -> tuple[str, bytes]:
    """The wait topic and message for ``request`` to come back at ``not_before``: its next turn.
    ``partition``: the partition of ``urls`` it came from, to go back to (``hand_back``)."""
    remaining = not_before - now
    tier = 0
    for i, seconds in enumerate(WAIT_TIER_SECONDS):
        if remaining >= seconds:
            tier = i
    # A turn of the shortest line ends at the URL's time if that is within two of its turns (no
    # wait ends on a sliver of a turn written behind the line's others: docs/decisions.md,
    # "Admission by need"); longer ones last their length, so each topic's messages fall due in
    # the order they were written.
    length = WAIT_TIER_SECONDS[tier]
    if tier == 0:
        due = now + (max(remaining, 0.0) if remaining < 2 * length else length)
    else:
        due = now + length
    return WAIT_TOPICS[tier], request.to_json(not_before=not_before, due=due, **_place(partition))


def _place(partition: int | None) -> dict[str, int]:
    return {} if partition is None else {"partition": partition}


def parked_message(request: CrawlRequest, partition: int | None) -> bytes:
    """A halted source's URL for ``urls_halted``, with the partition of ``urls`` it came from."""
    return request.to_json(**_place(partition))


def decoded(value: bytes | None) -> Any:
    """A waiting message's JSON, decoded once for the readers below (and ``hand_over.parse_or_reject``);
    None if it is none."""
    try:
        return json.loads(value or b"")
    except (ValueError, RecursionError):  # nested past the parser: rejected on hand-over, as any non-JSON
        return None


def hand_back(message: Any, url_partitions: int) -> dict[str, Any]:
    """Where a waiting URL goes back to in ``urls`` (``message``: its JSON, ``decoded``): the
    partition it was parked from, so a source's URLs stay spread as the splitter spread them (a
    fast source over several workers); else (a robots.txt wait, an older message, a value out of
    range) by its source's key."""
    partition = message.get("partition") if isinstance(message, dict) else None
    if isinstance(partition, int) and not isinstance(partition, bool) and 0 <= partition < url_partitions:
        return {"partition": partition}
    return {}


def wait_times(message: Any) -> tuple[float, float]:
    """(due, not_before) of a wait message (its JSON, ``decoded``); a damaged one is due now (and
    rejected on hand-over)."""
    try:
        return float(message["due"]), float(message["not_before"])
    except (ValueError, TypeError, KeyError):
        return 0.0, 0.0
