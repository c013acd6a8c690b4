"""The processes' Redis client: past its connections a call waits for one, it never fails (issue 20)."""
from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from common.redis_client import bounded_redis


async def test_more_calls_at_once_than_connections_wait_their_turn(redis_url: str, unique: str) -> None:
    """150 calls that each hold a connection for 50 ms, over 8 connections: all answered, none
    refused. redis-py's default pool (100 connections, then ``MaxConnectionsError``) fails this."""
    client = bounded_redis(redis_url, 8)
    observer = aioredis.from_url(redis_url)
    try:
        before = len(await observer.client_list())
        replies = await asyncio.gather(*(client.blpop([f"{unique}:empty:{n}"], timeout=0.05) for n in range(150)))
        held = len(await observer.client_list()) - before
    finally:
        await client.aclose()
        await observer.aclose()
    assert replies == [None] * 150
    assert 1 <= held <= 8
