"""One run of ``python -m url_lists crawl`` once its input is checked: the parts it starts,
the threads that feed and collect, the progress bar, the stop and the summary."""
from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from confluent_kafka import Producer
from redis import Redis
from tqdm import tqdm

from common import contracts
from common.contracts import INBOUND_PARTITIONS
from common.jsonlog import LOGGER, JsonFormatter, log_event
from common.kafka import ensure_topics, producer_config
from common.settings import Settings
from url_lists.crawl import checks
from url_lists.crawl.checks import Listing
from url_lists.crawl.feed import Feed, FeedTotals, Inbound, Stopped
from url_lists.crawl.local import LocalCrawl, crawler_env
from url_lists.crawl.options import CrawlOptions
from url_lists.dataset.keys import new_run_id
from url_lists.list_producer import SizeCounter

if TYPE_CHECKING:
    from url_lists.dataset.collector import Collector

EXIT_DONE, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
PROGRESS_LINE_SECONDS = 30.0  # without a terminal, a progress line this often


class Interrupted(Exception):
    """Ctrl-C or SIGTERM."""


class Failed(Exception):
    """The crawl cannot go on; the message says why, in one line."""


def _log_to(path: Path) -> None:
    """This process's JSON log (its own and the collector's events) to a file: stdout is the user's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(JsonFormatter())
    for old in list(LOGGER.handlers):
        LOGGER.removeHandler(old)
    LOGGER.addHandler(handler)


class Bar:
    """Outcomes a second and the ETA: tqdm on a terminal, a line every 30 s otherwise."""

    def __init__(self, progress: Callable[[], Any]):
        self._progress = progress
        self._tty = sys.stderr.isatty()
        self._bar: tqdm | None = None
        self._line_at = time.monotonic()
        self._started = time.monotonic()
        self._first: int | None = None

    def update(self) -> None:
        now = self._progress()
        total, done = now.rows_expected, now.outcomes
        counts = {"ok": now.successes, "rot": now.link_rot, "err": now.errors}
        if self._first is None:
            self._first = done
        if self._tty:
            if self._bar is None:
                self._bar = tqdm(total=total, initial=done, unit="outcome", smoothing=0.1, dynamic_ncols=True)
            self._bar.total = total
            self._bar.update(done - self._bar.n)
            self._bar.set_postfix(counts, refresh=False)
            return
        if time.monotonic() - self._line_at >= PROGRESS_LINE_SECONDS:
            self._line_at = time.monotonic()
            rate = (done - self._first) / max(1e-9, self._line_at - self._started)
            left = total - done
            eta = f"{left / rate:.0f} s" if rate > 0 else "?"
            print(f"{done}/{total} outcomes, {rate:.1f}/s, ETA {eta}; "
                  + ", ".join(f"{k} {v}" for k, v in counts.items()), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self.update()
            self._bar.close()


class CrawlRun:
    """One run of the command after the checks: started parts, threads, and their stop."""

    def __init__(self, options: CrawlOptions, listing: Listing, distributed: bool, env: Mapping[str, str]):
        self.options = options
        self.listing = listing
        self.distributed = distributed
        self.env = dict(env)
        self.folder = options.output_folder
        self.state_dir = self.folder / checks.CRAWL_DIR
        self.stop = threading.Event()
        self.local: LocalCrawl | None = None
        self.errors: list[str] = []
        self.totals: FeedTotals | None = None
        self.feed: Feed | None = None

    def execute(self) -> int:
        run = checks.start_run(self.options, self.listing.files, new_run_id)
        _log_to(self.state_dir / "logs" / "crawl.log")
        log_event(contracts.EVENT_LIST_CRAWL_STARTED, run=str(run.run), resumed=run.resumed, fleet=self.distributed,
                  files=[str(path) for path in self.listing.files])
        where = ("the fleet at " + self.env.get("KAFKA_HOSTS", "") if self.distributed else
                 f"this machine: the local stack, a monitor and {self.options.processes_count} worker(s)")
        print(f"{'resuming' if run.resumed else 'starting'} the crawl of {len(self.listing.files)} file(s) into "
              f"{self.folder} with {where}", file=sys.stderr, flush=True)
        started = time.monotonic()
        redis: Redis | None = None
        threads: list[threading.Thread] = []
        try:
            env = self.env
            if not self.distributed:
                self.local = LocalCrawl(self.state_dir / "stack", self.state_dir / "logs",
                                        self.options.processes_count,
                                        crawler_env(self.options, self.env, self.state_dir))
                env = self.local.start_stack()
                self._raise_if_stopped()
                self.local.start_crawler()
            # Imported once the crawler's processes are starting: its libraries (S3, HTTP, images)
            # load while they join their group, not before.
            from url_lists.dataset.collector import STATE_FILE as COLLECTOR_STATE
            from url_lists.dataset.collector import Collector, DatasetOptions
            if not self.distributed:  # a fresh broker: the collector's saved offsets are another's
                (self.state_dir / COLLECTOR_STATE).unlink(missing_ok=True)
            settings = Settings.from_env(env)
            ensure_topics(settings.kafka_hosts, [contracts.INBOUND_TOPIC], INBOUND_PARTITIONS)
            collector = Collector(DatasetOptions(folder=self.folder, output_format=self.options.output_format,
                                                 per_shard=self.options.number_sample_per_shard,
                                                 image_size=self.options.image_size, run=run.run), settings)
            finished = collector.finished_rows()
            redis = Redis.from_url(settings.redis_url, decode_responses=True)
            sizes = SizeCounter(redis, str(run.run))
            producer = Producer(producer_config(settings.kafka_hosts, **{"linger.ms": 50, "enable.idempotence": True}))
            self.feed = Feed(self.listing, self.folder, self.options.number_sample_per_shard, run.run,
                             Inbound(producer, self.stop).send,
                             lambda counts, end: sizes.add(counts, (0, end)), collector, finished, self.stop)
            threads = [self._thread("collector", lambda: collector.run(self.stop)),
                       self._thread("feed", self._feed)]
            bar = Bar(collector.progress)
            try:
                while threads[0].is_alive():
                    self._raise_if_stopped()
                    self._raise_on_trouble()
                    bar.update()
                    threads[0].join(0.5)
            finally:
                bar.close()
            self._raise_on_trouble()
            self._raise_if_stopped()
        except Interrupted:
            print("interrupted: stopping what it started; run the same command again to resume",
                  file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED
        except Failed as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return EXIT_FAILED
        except Exception as exc:  # noqa: BLE001 - a server that did not start, a broker that refused...
            log_event(contracts.EVENT_LIST_CRAWL_FAILED, part="command", error=repr(exc))
            print(f"error: {type(exc).__name__}: {exc}; run the same command again to resume",
                  file=sys.stderr, flush=True)
            return EXIT_FAILED
        finally:
            self.stop.set()
            for thread in threads:
                thread.join(30)
            if redis is not None:
                redis.close()
            if self.local is not None:
                self.local.stop()
            totals = self.feed.totals if self.feed else FeedTotals()
            log_event(contracts.EVENT_LIST_CRAWL_STOPPED, seconds=round(time.monotonic() - started, 1),
                      errors=self.errors, rows=totals.rows, bad=totals.bad, produced=totals.produced,
                      already=totals.already)
        if self.local is not None:
            self.local.discard_data()  # every shard is published: no thumbnail is needed again
        self._summary(collector, time.monotonic() - started)
        return EXIT_DONE

    def _thread(self, name: str, target: Callable[[], Any]) -> threading.Thread:
        def run() -> None:
            try:
                target()
            except Stopped:
                pass
            except Exception as exc:  # noqa: BLE001 - reported as the crawl's failure, and stops it
                log_event(contracts.EVENT_LIST_CRAWL_FAILED, part=name, error=repr(exc))
                self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                self.stop.set()
        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        return thread

    def _feed(self) -> None:
        assert self.feed is not None
        self.totals = self.feed.run()

    def _raise_if_stopped(self) -> None:
        if self.stop.is_set() and not self.errors:
            raise Interrupted()

    def _raise_on_trouble(self) -> None:
        if self.errors:
            raise Failed(self.errors[0])
        if self.local is not None:
            dead = self.local.died()
            if dead is not None:
                raise Failed(f"{dead.name} exited with status {dead.exited()} (see {dead.log_path}); "
                             "run the same command again to resume")

    def _summary(self, collector: Collector, seconds: float) -> None:
        for line in collector.summary_lines():
            print(line)
        print(f"took {seconds:,.0f} s; output: {self.folder} ({self.options.output_format}); "
              f"logs: {self.state_dir / 'logs'}")


