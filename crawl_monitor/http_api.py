"""The monitor's HTTP face: Prometheus metrics, a JSON status and a dashboard.

The JSON log is the record; this is for the people and scrapers watching a
crawl live. Everything is read from Redis (the cluster's shared state) or
from the monitor's latest ``monitoring_update``, so the server holds no
state of its own except one hour of samples for the dashboard's chart.

Wiring it into the monitor's main::

    runner = await start_http_api(settings, redis, lambda: monitoring.latest)
    try:
        ...                      # the components
    finally:
        await runner.cleanup()   # stops the server and the sampler

``start_http_api(settings_or_port, redis, latest_update, *, host=None,
sample_every=5.0, clock=time.time) -> aiohttp.web.AppRunner``. ``settings_or_port`` is a
``Settings`` (its ``monitor_port``, MONITOR_PORT, on its ``listen_host``,
LISTEN_HOST) or a port number (0 picks a free port: read it from
``runner.addresses[0][1]``) on ``host`` (every interface if None). ``redis`` is a
``redis.asyncio`` client, with or without ``decode_responses``.
``latest_update`` takes no argument and returns the latest
``monitoring_update`` dict (SPEC.md §4) or None before the first one.
``clock``: Unix time as the activity scores are read (the monitor's ``RedisClock.now``).

Endpoints:

- ``/metrics``: Prometheus text format (SPEC.md §6), per source active in the last
  10 minutes (``active_sources``, ``waiting_sources``) or halted or paused (label ``source``), not
  every source ever seen, and at most ``SHOWN_SOURCES``: the stopped first, then the latest active:
  ``crawler_source_requests_total``, ``crawler_source_successes_total``,
  ``crawler_source_errors_total`` (label ``status``),
  ``crawler_source_limit_requests_per_second`` (the computed or overridden rate),
  ``crawler_source_ceiling_requests_per_second`` (the most it may be granted: the limit,
  or capacity discovery's ceiling),
  ``crawler_source_granted_requests_per_second`` (what the monitor grants now),
  ``crawler_source_tokens``, ``crawler_source_halted``, ``crawler_source_temp_halted``
  (0 or 1), the adaptive back-off's ``crawler_source_response_seconds`` (label
  ``window``: ``baseline`` or ``recent``) and ``crawler_source_adaptive`` (0 while
  switched off), ``crawler_source_backlog`` (URLs split and not yet ended:
  ``urls_split:{source}`` - ``urls_ended:{source}``); and the monitor process's own
  ``process_*`` (CPU, memory, file descriptors).
- ``/status``: the latest ``monitoring_update`` as JSON (its own keys
  unchanged; ``event`` is null before the first one), plus ``sources`` (the
  live per-source state from Redis, with the achieved request rate, of the sources
  ``/metrics`` shows; ``sources_omitted`` counts the others seen) and
  ``history`` (samples of the last hour, oldest first; ``?since=UNIX_TIME``
  returns only newer ones, so the dashboard fetches increments).
- ``/``: the dashboard (``static/``), which polls ``/status``.
"""
from __future__ import annotations

import asyncio
import heapq
import json
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any
from collections.abc import AsyncIterator, Callable, Iterable

from aiohttp import web
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from redis.asyncio import Redis
from redis.exceptions import RedisError

from common.contracts import EVENT_HTTP_API_ERROR, EVENT_HTTP_API_STARTED, INBOUND_SOURCES
from common.cancel import cancel_and_wait
from common.jsonlog import log_event
from common.settings import Settings
from crawl_monitor.source_state import ChartReads, SourceState, read_sources, shown_sources

STATIC_DIR = Path(__file__).resolve().parent / "static"
SAMPLE_SECONDS = 5.0  # the monitor logs an update every 5 s; sampling faster adds nothing
HISTORY_SECONDS = 3600.0
HISTORY_FULL_SECONDS = 600.0  # samples newer than this are all kept; older ones thinned
HISTORY_THIN_SECONDS = 30.0
HISTORY_SOURCES = 50          # per-source series kept in each sample: the busiest
SHOWN_SOURCES = 1000          # /status and /metrics serve at most this many: stopped first, then the latest active
GENERAL_CHART_KEYS = ("success_rps", "error_rps", "processing_rate", "global_max_rps")

UpdateGetter = Callable[[], "dict[str, Any] | None"]


# --- /metrics ------------------------------------------------------------------
class SourcesCollector(Collector):
    """Renders one Redis snapshot as metric families.

    ``collect()`` is synchronous and the Redis client is async, so the
    handler awaits the snapshot at scrape time and this turns it into
    metrics; a fresh registry per scrape keeps concurrent scrapes apart.
    """

    def __init__(self, sources: dict[str, SourceState]):
        self.sources = sources

    def collect(self) -> Iterable[Any]:
        per_source: list[CounterMetricFamily | GaugeMetricFamily] = [
            CounterMetricFamily("crawler_source_requests", "Requests workers sent (num_requests:{source}).",
                                labels=["source"]),
            CounterMetricFamily("crawler_source_successes", "Images resized (num_resized:{source}).",
                                labels=["source"]),
            GaugeMetricFamily("crawler_source_limit_requests_per_second", "The source's rate limit: computed "
                              "from its size or overridden (adaptive:{source} limit, else override_rate).",
                              labels=["source"]),
            GaugeMetricFamily("crawler_source_ceiling_requests_per_second", "The most the monitor may grant: the "
                              "limit, or DISCOVERY_MAX_RATE while the source may discover its capacity "
                              "(adaptive:{source} ceiling).", labels=["source"]),
            GaugeMetricFamily("crawler_source_granted_requests_per_second", "Rate the monitor grants now: the "
                              "limit as the adaptive back-off allows it, 0 while stopped (rate_limit:{source}).",
                              labels=["source"]),
            GaugeMetricFamily("crawler_source_tokens", "Tokens left in the bucket (currtokens:{source}).",
                              labels=["source"]),
            GaugeMetricFamily("crawler_source_halted", "1 if the circuit breaker halted the source (halted).",
                              labels=["source"]),
            GaugeMetricFamily("crawler_source_temp_halted", "1 if the source is paused for an error surge "
                              "(temp_halted).", labels=["source"]),
        ]
        requests, successes, limit, ceiling, granted, tokens, halted, temp_halted = per_source
        errors = CounterMetricFamily("crawler_source_errors", "Failures by status "
                                     "(resize_errors:{source}:{status}).", labels=["source", "status"])
        response = GaugeMetricFamily("crawler_source_response_seconds", "Median time to first byte: the site's "
                                     "lightly loaded baseline, and recent.", labels=["source", "window"])
        adaptive = GaugeMetricFamily("crawler_source_adaptive", "0 while adaptive_off:{source} is set.",
                                     labels=["source"])
        backlog = GaugeMetricFamily("crawler_source_backlog", "URLs split and not yet ended "
                                    "(urls_split:{source} - urls_ended:{source}).", labels=["source"])
        opted_out = CounterMetricFamily("crawler_source_opted_out", "URLs the site opted out of, by the signal "
                                        "that decided (opted_out:{source}).", labels=["source", "signal"])
        for source, state in self.sources.items():
            for signal, urls in state.opted_out.items():
                opted_out.add_metric([source, signal], urls)
            requests.add_metric([source], state.requests)
            successes.add_metric([source], state.successes)
            own = next((rate for rate in (state.limit, state.ceiling, state.override) if rate is not None), None)
            if own is not None:
                limit.add_metric([source], own)
            top = state.ceiling if state.ceiling is not None else own
            if top is not None:
                ceiling.add_metric([source], top)
            if state.rate_limit is not None:
                granted.add_metric([source], state.rate_limit)
            if state.tokens is not None:
                tokens.add_metric([source], state.tokens)
            halted.add_metric([source], int(state.halted))
            temp_halted.add_metric([source], int(state.temp_halted))
            for status, count in state.errors.items():
                errors.add_metric([source, status], count)
            for window, ms in (("baseline", state.baseline_ms), ("recent", state.recent_ms)):
                if ms is not None:
                    response.add_metric([source, window], ms / 1000)
            adaptive.add_metric([source], int(state.adaptive))
            backlog.add_metric([source], state.backlog)
        yield from per_source
        yield from (errors, response, adaptive, backlog, opted_out)


def render_metrics(sources: dict[str, SourceState]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SourcesCollector(sources))
    ProcessCollector(registry=registry)
    return generate_latest(registry)


# --- History for the chart ---------------------------------------------------
class History:
    """The last hour of samples: the log is a stream and Prometheus may not be
    deployed, so the dashboard's chart needs a short memory of its own.

    Bounded in bytes whatever the number of sources: a sample keeps the summed request
    rate and the per-source series of only the ``HISTORY_SOURCES`` busiest sources, and
    samples older than ``HISTORY_FULL_SECONDS`` are thinned to one per
    ``HISTORY_THIN_SECONDS``. Every source's latest achieved rate is kept apart."""

    def __init__(self, span: float = HISTORY_SECONDS):
        self.span = span
        self.samples: deque[dict[str, Any]] = deque()
        self._last_requests: dict[str, int] = {}
        self._last_time: float | None = None
        self._achieved: dict[str, float] = {}

    def add(self, now: float, update: dict[str, Any] | None,
            sources: dict[str, SourceState] | None, read: Iterable[str] | None = None) -> dict[str, Any]:
        """Record one sample; the achieved rate is requests since the last one. ``read``: the sources
        whose state was read now (None: all); any other's count has not moved, so its rate is 0
        and the work follows the sources read, not those shown."""
        general = (update or {}).get("general") or {}
        sample: dict[str, Any] = {
            "time": now,
            "general": {k: general.get(k) for k in GENERAL_CHART_KEYS} if general else None,
            "sources": {},
        }
        elapsed = now - self._last_time if self._last_time is not None else 0.0
        rates: dict[str, float | None] = {}
        if sources is not None:
            full = read is None
            for source in sources if read is None else read:
                requests = sources[source].requests
                before = self._last_requests.get(source)
                rates[source] = (max(requests - before, 0) / elapsed
                                 if before is not None and elapsed > 0 else None)
                self._last_requests[source] = requests
            if full:  # only the sources shown are remembered
                self._last_requests = {s: n for s, n in self._last_requests.items() if s in sources}
            self._achieved = {s: rps for s, rps in rates.items() if rps is not None}
            self._last_time = now
        unread = 0.0 if elapsed > 0 else None  # a source not read has not moved
        known = [rps for rps in rates.values() if rps is not None]
        if unread is not None and sources is not None and len(rates) < len(sources):
            known.append(unread)
        sample["requests_rps"] = sum(known) if known else None
        moving = sorted((s for s, rps in rates.items() if rps), key=lambda s: (-(rates[s] or 0.0), s))
        busiest = moving[:HISTORY_SOURCES]
        if sources is not None and len(busiest) < HISTORY_SOURCES:  # the rest by name, as ties at 0
            taken = set(busiest)
            busiest += heapq.nsmallest(HISTORY_SOURCES - len(busiest), (s for s in sources if s not in taken))
        sample["sources"] = {s: {"rps": rates.get(s, unread), "rate_limit": (sources or {})[s].rate_limit}
                             for s in sorted(busiest)}
        self.samples.append(sample)
        self._thin(now)
        return sample

    def _thin(self, now: float) -> None:
        while self.samples and self.samples[0]["time"] < now - self.span:
            self.samples.popleft()
        kept: deque[dict[str, Any]] = deque()
        last_kept = float("-inf")
        for sample in self.samples:
            recent = sample["time"] >= now - HISTORY_FULL_SECONDS
            if recent or sample["time"] - last_kept >= HISTORY_THIN_SECONDS:
                kept.append(sample)
                last_kept = sample["time"]
        self.samples = kept

    def since(self, after: float) -> list[dict[str, Any]]:
        return [s for s in self.samples if s["time"] > after]

    def achieved_rps(self, source: str) -> float | None:
        """Its rate over the last sample: 0 for a source known and not read then (its count had not moved)."""
        rate = self._achieved.get(source)
        return rate if rate is not None or source not in self._last_requests else 0.0


# --- The server --------------------------------------------------------------
class _Api:
    def __init__(self, redis: Redis, latest_update: UpdateGetter, history: History,
                 clock: Callable[[], float] = time.time):
        self.redis = redis
        self.latest_update = latest_update
        self.history = history
        self.clock = clock

    def _update(self) -> dict[str, Any] | None:
        """A failing callable must not take the dashboard down with it."""
        try:
            return self.latest_update()
        except Exception as exc:  # noqa: BLE001 - anything the monitor raises
            log_event(EVENT_HTTP_API_ERROR, where="latest_update", error=repr(exc))
            return None

    async def metrics(self, request: web.Request) -> web.Response:
        try:
            sources = await read_sources(self.redis, among=await shown_sources(self.redis, self.clock(), SHOWN_SOURCES))
        except RedisError as exc:
            log_event(EVENT_HTTP_API_ERROR, where="metrics", error=repr(exc))
            return web.Response(status=503, text=f"cannot read Redis: {exc}\n")
        return web.Response(body=render_metrics(sources),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def status(self, request: web.Request) -> web.Response:
        try:
            since = float(request.query.get("since", "0"))
        except ValueError:
            raise web.HTTPBadRequest(text="since must be a Unix time in seconds\n") from None
        body: dict[str, Any] = dict(self._update() or {"event": None})
        try:
            sources = await read_sources(self.redis, among=await shown_sources(self.redis, self.clock(), SHOWN_SOURCES))
            body["sources"] = {s: {**asdict(state), "error_total": state.error_total,
                                   "achieved_rps": self.history.achieved_rps(s)}
                               for s, state in sources.items()}  # in name order
            body["sources_omitted"] = max(0, await self.redis.scard(INBOUND_SOURCES) - len(sources))
        except RedisError as exc:
            body["sources"], body["redis_error"] = None, str(exc)
        body["history"] = self.history.since(since)
        body["server_time"] = self.clock()
        return web.Response(text=json.dumps(body, default=str), content_type="application/json")

    async def index(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html")

    async def sample_forever(self, every: float) -> None:
        chart = ChartReads(self.redis, self.clock)
        while True:
            try:
                read = await chart.sample()
                self.history.add(self.clock(), self._update(), chart.states, read)
            except RedisError as exc:
                log_event(EVENT_HTTP_API_ERROR, where="sampler", error=repr(exc))
                self.history.add(self.clock(), self._update(), None)
            await asyncio.sleep(every)


def make_app(redis: Redis, latest_update: UpdateGetter, sample_every: float = SAMPLE_SECONDS,
             clock: Callable[[], float] = time.time) -> web.Application:
    api = _Api(redis, latest_update, History(), clock)

    async def sampler(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(api.sample_forever(sample_every))
        yield
        await cancel_and_wait([task])

    app = web.Application()
    app.cleanup_ctx.append(sampler)
    app.router.add_get("/", api.index)
    app.router.add_get("/metrics", api.metrics)
    app.router.add_get("/status", api.status)
    app.router.add_static("/static/", STATIC_DIR)
    return app


async def start_http_api(settings_or_port: Settings | int, redis: Redis, latest_update: UpdateGetter,
                         *, host: str | None = None, sample_every: float = SAMPLE_SECONDS,
                         clock: Callable[[], float] = time.time) -> web.AppRunner:
    """Serve until ``await runner.cleanup()``; see the module docstring."""
    if isinstance(settings_or_port, int):
        port, host = settings_or_port, host or Settings.listen_host
    else:
        port, host = settings_or_port.monitor_port, settings_or_port.listen_host
    # A dashboard needs no long goodbye: in-flight requests get 2 s, not aiohttp's 60.
    runner = web.AppRunner(make_app(redis, latest_update, sample_every, clock), access_log=None,
                           shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    log_event(EVENT_HTTP_API_STARTED, host=host, port=runner.addresses[0][1])
    return runner
