"""A worker's own figures for Prometheus, on ``WORKER_METRICS_PORT`` (SPEC.md §6).

The monitor's ``/metrics`` says how each source is doing, read from Redis; this says
how one worker is doing, so that a worker that is stuck, saturated or rebalancing
shows it. The metrics live here, module-level as prometheus-client intends; the code
that knows a figure calls a one-line hook (the fetcher, the task, the image pool, the
feed's rebalance callbacks), so the modules measured stay about their own job.

The server is prometheus-client's own thread, not the event loop: a worker whose loop
is stuck still answers, and says so (``crawler_worker_event_loop_lag_seconds`` grows,
outcomes stop). What lives in the loop's own structures (the scheduler's queues, the
bodies held) is read by the loop, once a second (``sample_forever``), never from the
server's thread. No metric has a ``source`` label: a worker crawls thousands of
sources, and the monitor has them per source.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics,
                               start_http_server)
from redis.exceptions import RedisError

from common.contracts import EVENT_WORKER_METRICS_STARTED, HALTED_URLS_TOPIC, LINK_ROT_TOPIC, OPTED_OUT_TOPIC, SIGNALS
from common.jsonlog import log_event
from worker.constants import DOWNLOAD_BUCKETS, FIRST_BYTE_BUCKETS, METRICS_SAMPLE_SECONDS

# No ``*_created`` series beside each counter and histogram: they double the series for a
# start time that process_start_time_seconds already gives.
disable_created_metrics()
REGISTRY = CollectorRegistry()
# The worker process's own CPU and memory (process_cpu_seconds_total, process_resident_memory_bytes, ...).
ProcessCollector(registry=REGISTRY)

# Label values, each series created at 0 so that rate() and absent() work from the start.
# Link rot is named as its topic is.
OUTCOME_KINDS = ("success", LINK_ROT_TOPIC, "crawl_error", "retry", "robots_wait", "rejected", OPTED_OUT_TOPIC)
SUCCESS, LINK_ROT, CRAWL_ERROR, RETRY, ROBOTS_WAIT, REJECTED, OPTED_OUT = OUTCOME_KINDS
SLOT_CLASSES = ("reserved", "shared")  # worker.scheduling.slots: slots reserved by need, and the shared floor
RESERVED, SHARED = SLOT_CLASSES
INFRA_SERVICES = ("redis", "kafka", "s3", "memory")

TASKS_IN_FLIGHT = Gauge("crawler_worker_tasks_in_flight", "Image tasks running, by the slots they run on.",
                        ["class"], registry=REGISTRY)
TASKS_WAITING = Gauge("crawler_worker_tasks_waiting", "URLs read from Kafka and queued here, not yet started.",
                      registry=REGISTRY)
SLOTS = Gauge("crawler_worker_slots", "Task slots: reserved for sources by need (rate x latency), and shared "
              "(the floor every other source takes in turn); MAX_TASKS in all.", ["class"], registry=REGISTRY)
FIRST_BYTE = Histogram("crawler_worker_first_byte_seconds", "Time to first byte of each response, from the "
                       "request written.", buckets=FIRST_BYTE_BUCKETS, registry=REGISTRY)
DOWNLOAD = Histogram("crawler_worker_download_seconds", "Time to download an image (2xx), from the request "
                     "written to the body's last byte.", buckets=DOWNLOAD_BUCKETS, registry=REGISTRY)
DOWNLOADED_BYTES = Counter("crawler_worker_downloaded_bytes", "Bytes of image bodies downloaded.",
                           registry=REGISTRY)
OUTCOMES = Counter("crawler_worker_outcomes", "URLs ended or handed on: success, link_rot, crawl_error (terminal); "
                   "retry (sent back to inbound_images), robots_wait (waiting for robots.txt), rejected "
                   "(an unreadable message), opted_out (terminal: the site's consent signals said no).",
                   ["kind"], registry=REGISTRY)
OPTED_OUT_SIGNALS = Counter("crawler_worker_opted_out", "URLs ended in opted_out, by the signal that decided "
                            "(SPEC.md §1: robots-txt, tdmrep-file, x-robots-tag, ...).", ["signal"],
                            registry=REGISTRY)
IMAGE_PROCESSES = Gauge("crawler_worker_image_pool_processes", "Processes in the image pool.", registry=REGISTRY)
IMAGE_PROCESSES_BUSY = Gauge("crawler_worker_image_pool_busy_processes", "Image processes with an image in hand "
                             "now.", registry=REGISTRY)
IMAGE_BUSY_SECONDS = Counter("crawler_worker_image_pool_busy_seconds", "Seconds the image processes had an image "
                             "in hand, summed over processes: its rate over image_pool_processes is the pool's "
                             "busy share.", registry=REGISTRY)
BODY_BUDGET = Gauge("crawler_worker_body_budget_bytes", "BODY_BUDGET_BYTES: memory bodies not yet analysed may "
                    "hold before downloads wait.", registry=REGISTRY)
BODY_BUDGET_USED = Gauge("crawler_worker_body_budget_used_bytes", "Memory held now by bodies being received or "
                         "waiting for the image pool.", registry=REGISTRY)
PARTITIONS = Gauge("crawler_worker_partitions", "Kafka partitions this worker owns, by consumer group.",
                   ["group"], registry=REGISTRY)
REBALANCES = Counter("crawler_worker_rebalances", "Partition assignments received, by consumer group (each ends "
                     "a rebalance, during which the group reads nothing).", ["group"], registry=REGISTRY)
SINCE_REBALANCE = Gauge("crawler_worker_seconds_since_rebalance", "Seconds since this worker's partitions last "
                        "changed (or it joined), by consumer group.", ["group"], registry=REGISTRY)
# Where a parked URL waits: a wait topic for its turn, or urls_halted for a resume.
PARK_PLACES = ("wait", HALTED_URLS_TOPIC)
PARKED_TO_WAIT, PARKED_TO_HALTED = PARK_PLACES
PARKED = Counter("crawler_worker_parked_urls", "URLs read from urls that their source could not take now, written "
                 "to wait in Kafka (two messages read and two written more than a URL crawled at once): "
                 "wait (its queue full, paused or temp_halted) or urls_halted (halted).", ["to"],
                 registry=REGISTRY)
INFRA_RETRIES = Counter("crawler_worker_infra_retries", "Calls to our own infrastructure retried (the task "
                        "waits, infra_retry in the log): redis, kafka, s3, memory (a body's segment).",
                        ["service"], registry=REGISTRY)
LOOP_LAG = Gauge("crawler_worker_event_loop_lag_seconds", "How late the event loop is for its once-a-second "
                 "sample: about 0 when healthy, growing while the loop is stuck.", registry=REGISTRY)

for _kind in OUTCOME_KINDS:
    OUTCOMES.labels(_kind)
for _class in SLOT_CLASSES:
    TASKS_IN_FLIGHT.labels(_class)
    SLOTS.labels(_class)
for _service in INFRA_SERVICES:
    INFRA_RETRIES.labels(_service)
for _place in PARK_PLACES:
    PARKED.labels(_place)
for _signal in SIGNALS:
    OPTED_OUT_SIGNALS.labels(_signal)


# --- hooks --------------------------------------------------------------------
def outcome(kind: str) -> None:
    OUTCOMES.labels(kind).inc()


def opted_out(signal: str) -> None:
    OUTCOMES.labels(OPTED_OUT).inc()
    OPTED_OUT_SIGNALS.labels(signal).inc()


def parked(to: str) -> None:
    PARKED.labels(to).inc()


def parked_so_far() -> dict[str, int]:
    """URLs parked by this process, by place (for ``worker_stopped``)."""
    return {place: int(PARKED.labels(place)._value.get()) for place in PARK_PLACES}


def downloaded(seconds: float, size: int) -> None:
    DOWNLOAD.observe(seconds)
    DOWNLOADED_BYTES.inc(size)


def infra_retry(what: str, error: BaseException) -> None:
    """``what`` as ``worker.outcomes.task.persist`` names it: ``kafka_send:{topic}``, ``s3_put``,
    ``redis_stats``, ``fetch_infrastructure`` (Redis, or memory for a body's segment)."""
    if isinstance(error, RedisError) or what.startswith("redis"):
        service = "redis"
    elif what.startswith("kafka"):
        service = "kafka"
    elif what.startswith("s3"):
        service = "s3"
    else:
        service = "memory"
    INFRA_RETRIES.labels(service).inc()


class _Rebalances:
    """Partitions owned per consumer group, from the feed's assignment callbacks (which run
    on the consumer's thread: the metrics are thread-safe, and the times are plain floats)."""

    def __init__(self) -> None:
        self._changed_at: dict[str, float] = {}

    def joined(self, group: str) -> None:
        if group not in self._changed_at:
            SINCE_REBALANCE.labels(group).set_function(lambda: time.monotonic() - self._changed_at[group])
            PARTITIONS.labels(group)
            REBALANCES.labels(group)
        self._changed_at[group] = time.monotonic()

    def assigned(self, group: str, count: int) -> None:
        PARTITIONS.labels(group).inc(count)
        REBALANCES.labels(group).inc()
        self._changed_at[group] = time.monotonic()

    def revoked(self, group: str, count: int) -> None:
        PARTITIONS.labels(group).dec(count)
        self._changed_at[group] = time.monotonic()


REBALANCE = _Rebalances()


class _BusyTime:
    """Seconds each image process has work: from the first request it is given to its
    last answer (a second request waits behind the one being worked on)."""

    def __init__(self) -> None:
        self._busy: dict[Hashable, tuple[int, float]] = {}  # process -> (requests in hand, busy since)
        IMAGE_PROCESSES_BUSY.set_function(lambda: len(self._busy))

    @contextmanager
    def busy(self, process: Hashable) -> Iterator[None]:
        count, since = self._busy.get(process, (0, time.monotonic()))
        self._busy[process] = (count + 1, since)
        try:
            yield
        finally:
            count, since = self._busy.pop(process)
            if count > 1:
                self._busy[process] = (count - 1, since)
            else:
                IMAGE_BUSY_SECONDS.inc(time.monotonic() - since)


IMAGE_POOL = _BusyTime()


# --- what the loop reads once a second ------------------------------------------
@dataclass(frozen=True)
class SchedulerLoad:
    """The scheduler's queues and slots (``Scheduler.load``)."""
    waiting: int
    in_flight: dict[str, int] = field(default_factory=dict)  # by slot class
    slots: dict[str, int] = field(default_factory=dict)


def report(load: SchedulerLoad, body_bytes_held: int) -> None:
    TASKS_WAITING.set(load.waiting)
    for slot_class in SLOT_CLASSES:
        TASKS_IN_FLIGHT.labels(slot_class).set(load.in_flight.get(slot_class, 0))
        SLOTS.labels(slot_class).set(load.slots.get(slot_class, 0))
    BODY_BUDGET_USED.set(body_bytes_held)


async def sample_forever(load: Callable[[], SchedulerLoad], body_bytes_held: Callable[[], int],
                         every: float = METRICS_SAMPLE_SECONDS) -> None:
    """Read the loop's figures every ``every`` s, until cancelled; the loop's lag is how late
    the next reading is, as the server's thread sees it."""
    sampled_at = time.monotonic()
    LOOP_LAG.set_function(lambda: max(0.0, time.monotonic() - sampled_at - every))
    while True:
        sampled_at = time.monotonic()
        report(load(), body_bytes_held())
        await asyncio.sleep(every)


# --- the server -----------------------------------------------------------------
class MetricsServer:
    """``/metrics`` on its own thread at ``host`` (LISTEN_HOST); ``port`` 0 takes a free port
    (``self.port`` says which)."""

    def __init__(self, port: int, host: str):
        try:
            self._server, self._thread = start_http_server(port, host, REGISTRY)
        except OSError as exc:  # one line, as for a bad setting: the port is taken, say
            raise SystemExit(f"error: WORKER_METRICS_PORT={port}: cannot serve /metrics: {exc}") from None
        self.port: int = self._server.server_address[1]
        log_event(EVENT_WORKER_METRICS_STARTED, host=host, port=self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
