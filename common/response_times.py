"""Response times as the workers record them and the monitor reads them (SPEC.md §2).

Each source's responses are counted per ``RESPONSE_BUCKET_SECONDS`` of wall-clock time
(``response_ms:{source}:{bucket start}``, a hash) in logarithmic bins of time to first
byte, four to a doubling (each bin ~19% wide), plus one ``overload`` field for the
answers that say the site is struggling (``common.statuses.is_overload``). A bucket
holds at most ~70 fields whatever the request rate, and expires on its own, so
the state neither grows with the rate nor outlives its use.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

RESPONSE_BUCKET_SECONDS = 2
RESPONSE_BUCKET_TTL_SECONDS = 60   # the monitor reads a bucket within seconds; the rest is for a person
OVERLOAD_FIELD = "overload"
_BINS_PER_DOUBLING = 4
_MAX_BIN = 68                      # 2**(69/4) ms: ~160 s, beyond any timeout


def bucket_start(now: float) -> int:
    return int(now // RESPONSE_BUCKET_SECONDS * RESPONSE_BUCKET_SECONDS)


def bin_of(seconds: float) -> int:
    """The bin of a time to first byte: bin i holds [2**(i/4), 2**((i+1)/4)) ms; 0 all below."""
    ms = seconds * 1000.0
    if not ms > 1.0:  # NaN too
        return 0
    return min(_MAX_BIN, int(math.log2(ms) * _BINS_PER_DOUBLING))


def _edges(index: int) -> tuple[float, float]:
    low = 0.0 if index == 0 else 2 ** (index / _BINS_PER_DOUBLING)
    return low, 2 ** ((index + 1) / _BINS_PER_DOUBLING)


def parse_bucket(raw: Mapping) -> tuple[dict[int, int], int]:
    """(counts by bin, overload count) from a bucket's hash; fields of another shape,
    or counts that are not whole positive numbers (an operator's typing), are ignored."""
    bins: dict[int, int] = {}
    overload = 0
    for key, value in raw.items():
        key = key.decode() if isinstance(key, bytes) else str(key)
        try:
            number = int(value)
        except (TypeError, ValueError):
            continue
        if number <= 0:
            continue
        if key == OVERLOAD_FIELD:
            overload += number
        elif key.isdigit() and int(key) <= _MAX_BIN:
            bins[int(key)] = bins.get(int(key), 0) + number
    return bins, overload


def median_ms(bins: Mapping[int, int]) -> float | None:
    """The median time to first byte in ms, interpolated within its bin (within ~10%)."""
    return quantile_ms(bins, 0.5)


def quantile_ms(bins: Mapping[int, int], share: float) -> float | None:
    """The time to first byte (ms) that ``share`` of the answers took at most, interpolated within its bin."""
    total = sum(bins.values())
    if not total:
        return None
    wanted, seen = total * share, 0
    for index in sorted(bins):
        if seen + bins[index] >= wanted:
            low, high = _edges(index)
            return low + (high - low) * (wanted - seen) / bins[index]
        seen += bins[index]
    raise AssertionError("unreachable: the counts sum to total")
