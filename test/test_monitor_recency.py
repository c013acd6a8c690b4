"""The sources by when they were last asked about (crawl_monitor.recency)."""
from __future__ import annotations

import pytest

from crawl_monitor.recency import Recency


@pytest.mark.parametrize("asks, cutoff, recent", [
    ([], 10, []),
    ([("a", 1), ("b", 2), ("c", 3)], 2, ["b", "c"]),
    ([("a", 1), ("b", 2), ("a", 3)], 2, ["a", "b"]),          # asked again: moved to the end
    ([("a", 1), ("b", 2), ("a", 3)], 2.5, ["a"]),
    ([("a", 5), ("b", 9), ("c", 1)], 4, ["a", "b"]),          # a clock stepped back: every one read
    ([("a", 5), ("b", 9), ("c", 1), ("c", 10)], 4, ["a", "b", "c"]),
])
def test_the_recent_sources_are_those_asked_since_the_cutoff(asks, cutoff, recent) -> None:
    recency = Recency()
    for source, at in asks:
        recency.ask(source, at)
    assert recency.since(cutoff) == recent
    assert recency.since(cutoff) == sorted(s for s, at in recency.at.items() if at >= cutoff)


@pytest.mark.parametrize("asks, cutoff, gone, kept", [
    ([("a", 1), ("b", 2), ("c", 3)], 2.5, ["a", "b"], ["c"]),
    ([("a", 1), ("b", 2), ("a", 3)], 2.5, ["b"], ["a"]),
    ([("a", 5), ("b", 9), ("c", 1)], 6, ["c", "a"], ["b"]),  # a clock stepped back: sorted again
])
def test_the_sources_not_asked_since_the_cutoff_are_dropped(asks, cutoff, gone, kept) -> None:
    recency = Recency()
    for source, at in asks:
        recency.ask(source, at)
    assert recency.older_than(cutoff) == gone
    assert list(recency.at) == kept
    recency.ask("d", 20)
    assert recency.since(cutoff) == sorted([*kept, "d"])
