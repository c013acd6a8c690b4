"""``python -m crawl_monitor``: splitter, rate-limit regulator, circuit breaker and monitoring log.

One process, one task per component, started once this monitor holds the
lease (``crawl_monitor.lease``): a second monitor is a standby. SIGTERM or
SIGINT stops them all, the buckets are emptied and the lease handed over on
the way out, and the exit status is 0; a component
that dies on its own stops the process with status 1, for the supervisor
to restart it (meanwhile the buckets expire: the crawl pauses, fail closed).
"""
from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any
from collections.abc import Callable, Coroutine

import aiohttp
import redis.asyncio as aioredis
from aiohttp import web

from common.contracts import (EVENT_HTTP_API_ERROR, EVENT_MONITOR_COMPONENT_ERROR, EVENT_MONITOR_STARTED,
                              EVENT_MONITOR_STOPPED)
from common.cancel import cancel_and_wait
from common.jsonlog import log_event
from common.redis_client import bounded_redis
from common.redis_clock import RedisClock
from common.settings import Settings, load_settings
from crawl_monitor import splitter
from crawl_monitor.adaptive import Adaptation
from crawl_monitor.circuit_breaker import CircuitBreaker
from crawl_monitor.http_api import start_http_api
from crawl_monitor.lease import MonitorLease
from crawl_monitor.constants import (BREAKER_CHECK_SECONDS, LEASE_RENEW_SECONDS, MONITORING_INTERVAL_SECONDS,
                                     REDIS_MAX_CONNECTIONS, TICK_SECONDS)
from crawl_monitor.monitoring import MonitoringLog
from crawl_monitor.periodic import every
from crawl_monitor.regulator import Regulator
from crawl_monitor.sources import refresh_sources


class ComponentFailed(Exception):
    """A component ended although nothing asked it to."""


async def run(settings: Settings, stop: asyncio.Event | None = None) -> None:
    """Run every component until ``stop`` is set (SIGTERM/SIGINT set it) or one of them fails.

    Nothing starts before this monitor holds the lease: a second monitor waits as a standby.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    redis = bounded_redis(settings.redis_url, REDIS_MAX_CONNECTIONS)
    lease = MonitorLease(redis)
    try:
        if await _first_done(lease.acquire(), stop.wait()) == "stopped":
            return
        await _run_components(settings, redis, lease, stop)
    finally:
        await redis.aclose()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


async def _first_done(acquiring: Coroutine[Any, Any, None], stopping: Coroutine[Any, Any, Any]) -> str:
    tasks = [asyncio.create_task(acquiring), asyncio.create_task(stopping)]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    await cancel_and_wait(pending)
    return "acquired" if tasks[0] in done else "stopped"


async def _run_components(settings: Settings, redis: aioredis.Redis, lease: MonitorLease,
                          stop: asyncio.Event) -> None:
    session = aiohttp.ClientSession()
    clock = RedisClock()  # the workers' activity scores are by Redis's clock: read them by it
    await clock.sync(redis)
    adaptation = Adaptation(redis, clock=clock.now)
    regulator = Regulator(redis, adaptation, default_rate=settings.default_source_rate,
                          discovery_max_rate=settings.discovery_max_rate, discovery_sources=settings.discovery_sources)
    lease.on_emptied = regulator.forget_written
    breaker = CircuitBreaker(redis)
    monitoring = MonitoringLog(redis, wall_clock=clock.now)
    dashboard = await _start_dashboard(settings, redis, monitoring, clock.now)
    components: dict[str, Coroutine[Any, Any, None]] = {
        "lease": every(LEASE_RENEW_SECONDS, lease.renew, "lease"),
        "clock": clock.keep_synced(redis),
        "splitter": splitter.run_splitter(lambda: splitter.connect(settings, limit_of=regulator.limit_of,
                                                                   clock=clock.now),
                                           settings.shutdown_timeout),
        "sources": refresh_sources(settings.sources_url, session, regulator.set_sizes),
        "regulator": every(TICK_SECONDS, lambda: _adapt_then_grant(adaptation, regulator, clock), "regulator"),
        "circuit_breaker": every(BREAKER_CHECK_SECONDS, lambda: breaker.check(clock.now()), "circuit_breaker"),
        "monitoring": every(MONITORING_INTERVAL_SECONDS, monitoring.update, "monitoring"),
    }
    tasks = [asyncio.create_task(coroutine, name=name) for name, coroutine in components.items()]
    stopping = asyncio.create_task(stop.wait())
    log_event(EVENT_MONITOR_STARTED, components=list(components), lease_holder=lease.holder)
    try:
        done, _ = await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
    finally:
        # The crawl stops first; the splitter may take a moment to finish its batch on its
        # thread (cancelled once: a second cancel would cut that wait short).
        splitting = tasks[list(components).index("splitter")]
        splitting.cancel()
        await cancel_and_wait([task for task in (stopping, *tasks) if task is not splitting])
        try:
            await regulator.empty_buckets()
        except Exception as exc:  # noqa: BLE001 - the keys expire on their own within 2 s
            log_event(EVENT_MONITOR_COMPONENT_ERROR, component="regulator",
                      error=f"could not empty the buckets: {exc}")
        results = await asyncio.gather(*tasks, return_exceptions=True)
        # Only now, with the splitter's last batch done, may a standby take over.
        try:
            await lease.release()
        except Exception as exc:  # noqa: BLE001 - it expires by itself
            log_event(EVENT_MONITOR_COMPONENT_ERROR, component="lease", error=f"could not release: {exc}")
        if dashboard is not None:
            await dashboard.cleanup()
        await session.close()
    # A component never returns by itself: one in ``done`` (other than ``stopping``) failed.
    failures = {task.get_name(): repr(result) for task, result in zip(tasks, results, strict=True) if task in done}
    log_event(EVENT_MONITOR_STOPPED, failed=failures)
    if failures:
        raise ComponentFailed(f"monitor component(s) stopped: {failures}")


async def _adapt_then_grant(adaptation: Adaptation, regulator: Regulator, clock: RedisClock) -> None:
    """The back-off's verdicts go out in the same second's grants: its slow start doubles a
    source's rate each second, and a tick's wait would make the loop twice as long. A failed
    update is logged and the regulator grants what the back-off allowed before."""
    try:
        await adaptation.update()
    except Exception as exc:  # noqa: BLE001 - the buckets must still be set
        log_event(EVENT_MONITOR_COMPONENT_ERROR, component="adaptation", error=f"{type(exc).__name__}: {exc}")
    await regulator.tick(clock.now())


async def _start_dashboard(settings: Settings, redis: aioredis.Redis, monitoring: MonitoringLog,
                           clock: Callable[[], float]) -> web.AppRunner | None:
    """The dashboard is for watching, the regulator is what keeps sites safe:
    a taken port is reported and the monitor carries on without the dashboard."""
    try:
        return await start_http_api(settings, redis, lambda: monitoring.latest, clock=clock)
    except OSError as exc:
        log_event(EVENT_HTTP_API_ERROR, port=settings.monitor_port,
                  error=f"dashboard not started: {exc}")
        return None


def main() -> None:
    settings = load_settings()
    try:
        asyncio.run(run(settings))
    except ComponentFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
