"""Many per-source keys of one kind read or written in one command: a script per batch.

The monitor reads a hash or a list per active source each second (response buckets,
adaptive states, last-50 lists) and writes a hash per judged source. Through a redis-py
pipeline each such command costs the monitor's CPU in packing, a coroutine per reply and
its dict callback; a script call is one command, its keys packed in one go and its
nested reply parsed by hiredis (as the regulator's REFILL does for the buckets).
``KEYS_BATCH`` keys a call, so that no call holds Redis (and every worker behind it) long.
"""
from __future__ import annotations

from itertools import chain
from typing import Any

from common.protocols import AsyncRedis

KEYS_BATCH = 500

# KEYS: n hashes; the reply: each one's HGETALL (field, value, field, value...).
HGETALL_MANY = """
local out = {}
for i, key in ipairs(KEYS) do out[i] = redis.call('HGETALL', key) end
return out
"""

# KEYS: n lists; ARGV: start, end; the reply: each one's LRANGE.
LRANGE_MANY = """
local out = {}
for i, key in ipairs(KEYS) do out[i] = redis.call('LRANGE', key, ARGV[1], ARGV[2]) end
return out
"""

# KEYS: n sets; the reply: each one's SMEMBERS.
SMEMBERS_MANY = """
local out = {}
for i, key in ipairs(KEYS) do out[i] = redis.call('SMEMBERS', key) end
return out
"""

# KEYS: n hashes; ARGV: their expiry (s), then per key its field count and its fields and values (an
# empty value deletes its field).
HSET_EXPIRE_MANY = """
local at = 2
for _, key in ipairs(KEYS) do
  local n = tonumber(ARGV[at])
  redis.call('HSET', key, unpack(ARGV, at + 1, at + 2 * n))
  for i = at + 2, at + 2 * n, 2 do
    if ARGV[i] == '' then redis.call('HDEL', key, ARGV[i - 1]) end
  end
  redis.call('EXPIRE', key, ARGV[1])
  at = at + 1 + 2 * n
end
return #KEYS
"""

# KEYS: n count-window hashes; ARGV: each key's cut-off. Drops the fields whose bucket start (the
# digits before the first ':'; -1 for a field of another shape) is at or below its key's cut-off, as
# ``contracts.bucket_of_field`` reads it; returns the fields dropped.
HDEL_BUCKETS_UP_TO = """
local dropped = 0
for i, key in ipairs(KEYS) do
  local cutoff = tonumber(ARGV[i])
  local old = {}
  for _, field in ipairs(redis.call('HKEYS', key)) do
    local head = string.match(field, '^[^:]*')
    local start = string.match(head, '^%d+$') and tonumber(head) or -1
    if start <= cutoff then old[#old + 1] = field end
  end
  for first = 1, #old, 1000 do
    redis.call('HDEL', key, unpack(old, first, math.min(first + 999, #old)))
  end
  dropped = dropped + #old
end
return dropped
"""


def _pairs(flat: list[Any]) -> dict[Any, Any]:
    """An HGETALL reply as a script returns it (field, value, ...) as redis-py's dict."""
    values = iter(flat)
    return dict(zip(values, values, strict=True))


class BatchedKeys:
    """The scripts registered on one client; each method answers in the order of ``keys``."""

    def __init__(self, redis: AsyncRedis):
        self._hgetall = redis.register_script(HGETALL_MANY)
        self._lrange = redis.register_script(LRANGE_MANY)
        self._smembers = redis.register_script(SMEMBERS_MANY)
        self._hset_expire = redis.register_script(HSET_EXPIRE_MANY)
        self._hdel_buckets = redis.register_script(HDEL_BUCKETS_UP_TO)

    async def hashes(self, keys: list[str]) -> list[dict[Any, Any]]:
        """Each key's HGETALL ({} for a missing key)."""
        return [_pairs(flat) for flat in await self._each_batch(self._hgetall, keys)]

    async def lists(self, keys: list[str], start: int, end: int) -> list[list[Any]]:
        """Each key's LRANGE ``start`` ``end``."""
        return await self._each_batch(self._lrange, keys, [start, end])

    async def sets(self, keys: list[str]) -> list[set[Any]]:
        """Each key's SMEMBERS."""
        return [set(members) for members in await self._each_batch(self._smembers, keys)]

    async def save_hashes(self, mappings: dict[str, dict[str, str]], seconds: int) -> None:
        """HSET each key's mapping (not empty) and EXPIRE it in ``seconds``; a field whose value is
        empty is deleted."""
        keys = list(mappings)
        for start in range(0, len(keys), KEYS_BATCH):
            batch = keys[start:start + KEYS_BATCH]
            args: list[Any] = [seconds]
            for key in batch:
                args.append(len(mappings[key]))
                args.extend(chain.from_iterable(mappings[key].items()))
            await self._hset_expire(keys=batch, args=args)

    async def drop_buckets_up_to(self, cutoffs: dict[str, float]) -> int:
        """In each count-window hash, HDEL the fields of the buckets that started at or before its
        cut-off; the number of fields dropped."""
        keys = list(cutoffs)
        dropped = 0
        for start in range(0, len(keys), KEYS_BATCH):
            batch = keys[start:start + KEYS_BATCH]
            dropped += await self._hdel_buckets(keys=batch, args=[cutoffs[key] for key in batch])
        return dropped

    @staticmethod
    async def _each_batch(script: Any, keys: list[str], args: list[Any] | None = None) -> list[Any]:
        replies: list[Any] = []
        for start in range(0, len(keys), KEYS_BATCH):
            replies.extend(await script(keys=keys[start:start + KEYS_BATCH], args=args or []))
        return replies
