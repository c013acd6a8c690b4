"""The asyncio Redis client every process uses: a bounded pool that waits, never fails.

redis-py's default asyncio pool raises ``MaxConnectionsError`` once its 100
connections are in use, as a worker's tasks do at thousands of sources
(docs/decisions.md, "Thousands of sources"). Running out of
connections is load, not an outage: a caller waits for the next free one.

Its registered scripts (a worker's token and stats per request) run over one
pipelined connection of their own instead (``common.redis_scripts``).
"""
from __future__ import annotations

import redis.asyncio as aioredis
from common.redis_scripts import PipelinedScriptsRedis
from redis.exceptions import (DataError, ExecAbortError, NoPermissionError, NoScriptError, OutOfMemoryError,
                              ReadOnlyError, ResponseError)

# Error replies about the server, not the command's keys or values: out of memory, a replica,
# no permission, a script still running, persistence failing, a cluster or failover in progress.
_SERVER_STATE_ERRORS = (OutOfMemoryError, ReadOnlyError, NoPermissionError, NoScriptError, ExecAbortError)
_SERVER_STATE_PREFIXES = ("BUSY", "MISCONF", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "NOREPLICAS", "LOADING",
                          "NOAUTH", "NOPERM", "OOM", "READONLY")


def bounded_redis(url: str, max_connections: int) -> aioredis.Redis:
    """A client over at most ``max_connections`` connections; a caller past them waits for one.
    Its scripts use one more connection, shared by all their calls."""
    pool = aioredis.BlockingConnectionPool.from_url(url, decode_responses=True, max_connections=max_connections,
                                                    timeout=None)
    return PipelinedScriptsRedis.from_pool(pool)


def refuses_the_value(exc: BaseException) -> bool:
    """Whether a Redis error is about the keys or values of the one command (``WRONGTYPE``, "value
    is not an integer", a value redis-py cannot encode), so that repeating it gets the same
    answer; errors about the server (a lost connection, OOM, a replica, ...) are outages."""
    if isinstance(exc, DataError):
        return True
    if not isinstance(exc, ResponseError) or isinstance(exc, _SERVER_STATE_ERRORS):
        return False
    return not str(exc).lstrip().upper().startswith(_SERVER_STATE_PREFIXES)
