"""One worker-like crawler process for the pacing tests: the worker's own fetch path
(``Fetcher``: gate, host slot, ``TokenBuckets``, ``HttpClient``) without Kafka, so
several of them can race for one source's tokens as real workers do.

``python -m test.pacing_crawler REDIS_URL PROCESSES SECONDS PLAN_JSON``: waits until
PROCESSES such processes have started (a Redis barrier), then for SECONDS keeps
``TASKS_PER_SOURCE`` tasks per source fetching ``{base_url}/img/{n}`` (PLAN_JSON maps
source -> base URL), reading the sources' rates from ``rate_limit:{source}`` as the
scheduler does, and prints its outcomes as JSON: {source: {status: count}}.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time

TASKS_PER_SOURCE = 6
RATE_REFRESH = 1.0  # seconds between reads of rate_limit:{source} (the scheduler: 2 s)


async def crawl(redis_url: str, processes: int, seconds: float, plan: dict[str, str]) -> dict[str, dict[str, int]]:
    import redis.asyncio as aioredis

    from common.contracts import rate_limit_key
    from common.settings import Settings
    from test.sites import TEST_USER_AGENT
    from worker.fetching.fetch import Fetcher, FetchError
    from worker.fetching.http_client import HttpClient
    from worker.politeness.gate import build_gate
    from worker.fetching.tokens import ShuttingDown, SourceHalted, TokenBuckets
    from worker.monitor_view import MonitorView

    settings = Settings(redis_url=redis_url, crawl_user_agent=TEST_USER_AGENT, crawl_allow_private_networks=True)
    redis = aioredis.from_url(redis_url, decode_responses=True)
    client = HttpClient(TEST_USER_AGENT)
    view = MonitorView()
    tokens = TokenBuckets(redis, view)
    fetcher = Fetcher(client, build_gate(settings, redis, client), tokens, 1 << 20)
    outcomes: dict[str, dict[str, int]] = {source: {} for source in plan}
    counter = iter(range(10**9))
    deadline = 0.0

    async def refresh_rates() -> None:
        while True:
            values = await redis.mget([rate_limit_key(s) for s in plan])
            view.decide(rates={s: float(v) for s, v in zip(plan, values, strict=True) if v and float(v) > 0})
            await asyncio.sleep(RATE_REFRESH)

    async def fetch_loop(source: str, base_url: str) -> None:
        while time.monotonic() < deadline:
            try:
                fetched = await fetcher.fetch(f"{base_url}/img/{os.getpid()}-{next(counter)}", source)
                fetched.body.release()
                status = str(fetched.status)
            except FetchError as error:
                status = error.status
            except (ShuttingDown, SourceHalted):
                return
            outcomes[source][status] = outcomes[source].get(status, 0) + 1

    try:
        await redis.incr("test_barrier")
        wait_until = time.monotonic() + 30
        while int(await redis.get("test_barrier") or 0) < processes and time.monotonic() < wait_until:
            await asyncio.sleep(0.02)
        refresher = asyncio.create_task(refresh_rates())
        await asyncio.sleep(0.1)  # the first rates are read
        deadline = time.monotonic() + seconds
        loops = [asyncio.create_task(fetch_loop(source, url))
                 for source, url in plan.items() for _ in range(TASKS_PER_SOURCE)]
        await asyncio.sleep(seconds)
        tokens.close()
        await asyncio.gather(*loops)
        refresher.cancel()
    finally:
        await client.close()
        await redis.aclose()
    return outcomes


if __name__ == "__main__":
    print(json.dumps(asyncio.run(crawl(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]),
                                       json.loads(sys.argv[4])))))
