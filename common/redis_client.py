"""The asyncio Redis client every process uses: a bounded pool that waits, never fails.

redis-py's default asyncio pool raises ``MaxConnectionsError`` once its 100
connections are in use; at thousands of sources a worker's tasks reached that
(issue 20: 3,674 ``infra_retry`` at 5,000 sources). Running out of
connections is load, not an outage: a caller waits for the next free one.
"""
from __future__ import annotations

import redis.asyncio as aioredis


def bounded_redis(url: str, max_connections: int) -> aioredis.Redis:
    """A client over at most ``max_connections`` connections; a caller past them waits for one."""
    pool = aioredis.BlockingConnectionPool.from_url(url, decode_responses=True, max_connections=max_connections,
                                                    timeout=None)
    return aioredis.Redis.from_pool(pool)
