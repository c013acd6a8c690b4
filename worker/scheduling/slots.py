"""How many concurrent tasks each source gets: by need, not equal shares.

A source needs about rate x latency tasks in flight to use its tokens (100
req/s at 0.2 s a request keeps 20 busy; headroom covers token bursts), and
no more than it has URLs here: a site with one URL left uses one slot,
whatever its rate. That many slots are *reserved* for it. Sources that need
no more than the floor (a 0.5 req/s site, a site with one URL here) run on
*shared* slots, one task each at most, taken in rotation, so no source
starves however many there are. At least half the worker's capacity (or
enough for every floor) stays shared, so one huge source cannot crowd out
the rest either.

The reference gave every source an equal share instead: with many slow
sources, a fast one got the same handful of slots as a 0.5 req/s one.
"""
from __future__ import annotations


def need(pace: float, latency: float, held: int, headroom: float) -> float:
    """Slots a source can keep busy: ``pace`` (req/s) x ``latency`` (s a task) x ``headroom``, but
    no more than the URLs it ``held`` here (queued and running)."""
    return min(pace * latency * headroom, float(held))


def reserve(needs: dict[str, float], capacity: int, floor: int, sources: int | None = None) -> dict[str, int]:
    """Slots reserved per source (its need rounded down), scaled to leave room for the floors of
    ``sources`` (default: those in ``needs``; a caller may leave out the sources that hold no more
    than the floor, which are never reserved)."""
    shared = min(floor * (len(needs) if sources is None else sources), capacity // 2)
    budget = capacity - shared
    wanted = {source: int(need) for source, need in needs.items() if int(need) > floor}
    total = sum(wanted.values())
    if total <= budget:
        return wanted
    return {source: slots * budget // total for source, slots in wanted.items()}
