"""One crawl worker's parts, wired together and run until SIGTERM (``python -m worker``).

SIGTERM (or Ctrl-C) stops taking work, lets requests in flight finish
within SHUTDOWN_TIMEOUT, commits what finished and exits 0; whatever did
not finish is re-delivered to the next worker.
"""
from __future__ import annotations

import asyncio
import signal
import threading


from common.contracts import EVENT_WORKER_STARTED, EVENT_WORKER_STOP_OVERDUE, EVENT_WORKER_STOPPED
from common.contracts import EVENT_TASK_CRASHED, HALTED_GROUP, WAIT_GROUP, WORKER_GROUP
from common.jsonlog import log_event
from common.redis_client import bounded_redis
from common.redis_clock import RedisClock
from common.process import exit_if_not_stopped_within
from common.kafka import AsyncProducer, producer_config
from common.settings import Settings
from worker.constants import REDIS_MAX_CONNECTIONS, STOP_MARGIN_SECONDS
from worker.intake.feed import KafkaFeed
from worker.intake.group_join import Joining, ensure_worker_topics, joined, worker_consumer
from worker.fetching.fetch import Fetcher
from worker import metrics
from worker.fetching.http_client import HttpClient
from worker.politeness.addresses import GuardedResolver
from worker.politeness.gate import build_gate, response_consent
from worker.imaging.pool import ImagePool
from worker.parking.hand_back_on_resume import HaltedLine
from worker.parking.hand_back_when_due import WaitLine
from worker.scheduling.scheduler import Scheduler
from worker.outcomes.stats import Stats
from worker.outcomes.task import ImageTask, persist
from worker.imaging.thumbnails import thumbnail_store
from worker.fetching.tokens import TokenBuckets
from worker.monitor_view import MonitorView


async def run(settings: Settings, metrics_server: metrics.MetricsServer | None, joining: Joining) -> None:
    """``joining``: the urls consumer subscribing while this module loaded; if that failed (Kafka
    away, say), the consumer is made here and subscribes once the topics exist."""
    redis = bounded_redis(settings.redis_url, REDIS_MAX_CONNECTIONS)
    producer = AsyncProducer(producer_config(settings.kafka_hosts))
    if (early := await joined(joining)) is None:
        consumer = worker_consumer(settings, WORKER_GROUP)
        feed = KafkaFeed(consumer, WORKER_GROUP, settings.url_partition_share)
    else:
        consumer, feed = early
    # URLs waiting in Kafka come back through consumers of their own (worker.parking).
    wait_consumer = worker_consumer(settings, WAIT_GROUP)
    halted_consumer = worker_consumer(settings, HALTED_GROUP)
    pool = ImagePool()
    # Images straight into shared memory, and each site's robots.txt and tdmrep.json on the same connections.
    images = HttpClient(settings.crawl_user_agent,
                        resolver=None if settings.crawl_allow_private_networks else GuardedResolver())
    try:
        async with thumbnail_store(settings) as thumbnails:
            view = MonitorView()  # what the monitor decided: the scheduler refreshes it, all three read it
            clock = RedisClock()  # activity is scored by Redis's clock, as the monitor reads it
            await clock.sync(redis)
            tokens = TokenBuckets(redis, view, clock=clock.now)
            fetcher = Fetcher(images, build_gate(settings, redis, images), tokens, settings.max_image_bytes,
                              body_budget=settings.body_budget_bytes, consent=response_consent(settings))
            task = ImageTask(fetcher, pool.analyze, thumbnails, producer, Stats(redis, clock=clock.now), settings)
            scheduler = Scheduler(feed, redis, task.process, producer, tokens, view,
                                  settings.max_tasks, settings.shutdown_timeout, settings.max_queued_urls)
            # Every topic this worker reads, so that a worker started before the monitor subscribes
            # to topics that exist (librdkafka would look for a missing one again only minutes later).
            await persist("kafka_create_topics", lambda: asyncio.to_thread(ensure_worker_topics, settings))
            lines: list[WaitLine | HaltedLine] = [
                WaitLine(KafkaFeed(wait_consumer, WAIT_GROUP), producer, redis, settings.url_partitions),
                HaltedLine(KafkaFeed(halted_consumer, HALTED_GROUP), producer, view,
                           settings.url_partitions)]
            loop = asyncio.get_running_loop()
            overdue: list[threading.Timer] = []

            def stop() -> None:
                scheduler.stop()
                if not overdue:  # from the first signal: draining, the wait lines and the producer's
                    # flush each take SHUTDOWN_TIMEOUT at most
                    overdue.append(exit_if_not_stopped_within(
                        3 * settings.shutdown_timeout + STOP_MARGIN_SECONDS, EVENT_WORKER_STOP_OVERDUE))

            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(signum, stop)
            log_event(EVENT_WORKER_STARTED, max_tasks=settings.max_tasks, processes=pool.processes)
            running = [asyncio.create_task(line.run()) for line in lines]
            metrics.BODY_BUDGET.set(settings.body_budget_bytes)
            sampling = asyncio.create_task(metrics.sample_forever(scheduler.load, fetcher.body_bytes_held))
            syncing = asyncio.create_task(clock.keep_synced(redis))
            # A line that died would leave its URLs uncommitted until this worker stops: stop
            # it now, so its supervisor restarts it and they come back.
            for line_task in running:
                line_task.add_done_callback(lambda done: None if done.cancelled() or done.exception() is None
                                            else scheduler.stop())
            try:
                await scheduler.run()
            finally:
                sampling.cancel()
                syncing.cancel()
                for line in lines:
                    line.stop()
                for line_task in running:
                    try:
                        await asyncio.wait_for(line_task, settings.shutdown_timeout)
                    except TimeoutError:
                        pass  # cancelled mid-poll: what it had not handed on is read again from the commit
                    except Exception as exc:
                        log_event(EVENT_TASK_CRASHED, topic="wait_line", error=repr(exc)[:500])
                        raise  # exit non-zero: a bug, for the supervisor and the operator to see
    finally:
        undelivered = await producer.close(settings.shutdown_timeout)
        await wait_consumer.close(leave_group=settings.kafka_leave_group)
        await halted_consumer.close(leave_group=settings.kafka_leave_group)
        await consumer.close(leave_group=settings.kafka_leave_group)
        await images.close()
        await redis.aclose()
        pool.close()
        if metrics_server is not None:
            metrics_server.close()
        log_event(EVENT_WORKER_STOPPED, undelivered=undelivered, parked=metrics.parked_so_far())
