"""Retry-After on 429/503: a site that says "slow down" gets a pause for the
whole source across the cluster, not just a retry from this one worker.

The pause is the Unix time (integer seconds, wall-clock, since workers on
different machines share it) in ``retry_after:{source}``; the monitor's
regulator gives the source no tokens until then.
"""
from __future__ import annotations

import math
from email.utils import parsedate_to_datetime
from collections.abc import Mapping

from common.contracts import retry_after_key, tokens_key

PAUSE_STATUSES = frozenset({429, 503})
MAX_PAUSE_SECONDS = 3600
# Without a Retry-After header a 429/503 still means "back off": one minute
# is long enough to relieve a struggling site and short enough not to stall
# a large source for long on one stray error.
DEFAULT_PAUSE_SECONDS = 60

# Set the pause only if it is later than the one stored: never shorten a pause.
# Also empty the source's bucket at once: the monitor applies the pause only at
# its next tick, and the rest of this second's tokens must not reach the site.
_EXTEND_PAUSE = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
local until_ = tonumber(ARGV[1])
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('SET', KEYS[2], '0', 'KEEPTTL')
end
if until_ > current then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
  return 1
end
return 0
"""


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Seconds to wait from now, or None when the header is absent or unparsable."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(int(value))
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None or when.tzinfo is None:
        return None  # RFC 9110 dates are always GMT; a naive one is garbage
    return max(0.0, when.timestamp() - now)


def pause_seconds(status: int, headers: Mapping[str, str], now: float) -> float | None:
    """How long a response asks the source to pause, capped; None if it does not."""
    if status not in PAUSE_STATUSES:
        return None
    seconds = parse_retry_after(headers.get("Retry-After"), now)
    if seconds is None:
        seconds = DEFAULT_PAUSE_SECONDS
    return min(seconds, MAX_PAUSE_SECONDS)


async def extend_pause(redis, source: str, seconds: float, now: float) -> int:
    """Pause source until now+seconds unless a later pause is stored; return now+seconds."""
    until = math.ceil(now + seconds)
    ttl = max(1, until - math.floor(now)) + 60
    await redis.eval(_EXTEND_PAUSE, 2, retry_after_key(source), tokens_key(source), str(until), str(ttl))
    return until
