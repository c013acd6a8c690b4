"""The embedded crawl: the local stack, a monitor and workers on this machine, all stopped together.

Kafka and Redis come from their wheels (``devstack``) with their data under the output
folder; no S3: the workers write thumbnails into a folder there (THUMBNAIL_DIR), which the
collector reads and empties shard by shard. The monitor and the workers are ``python -m crawl_monitor`` and
``python -m worker``, as an operator runs them. Every child has a process group of
its own and dies with this process (``common.process``), so a stop, Ctrl-C, SIGTERM
or even a SIGKILL of the command leaves nothing running; a stop SIGTERMs the workers
first (they finish or park what they hold), then the monitor, then kills the servers.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from common.process import own_group_dying_with_parent
from common.settings import DEFAULT_USER_AGENT
from devstack.servers import free_port
from devstack.stack import LOCAL_ENV, LocalStack

if TYPE_CHECKING:
    from url_lists.crawl.options import CrawlOptions

WORKER_MODULE = "worker"
MONITOR_MODULE = "crawl_monitor"
EMPTY_SOURCES = "[]"  # the embedded monitor's SOURCES_URL: every site is rated by its count in the list
# A URL whose host's robots.txt cannot be reached ends as RobotsUnavailable after this long
# (robots.txt tried at 30 s, 90 s, 210 s, 450 s), not the fleet's day: the command must end.
ROBOTS_GIVE_UP_SECONDS = 600
STOP_GRACE = 20.0  # seconds a worker gets to finish or park what it holds before it is killed
THUMBNAILS = "thumbnails"  # the thumbnails' folder in the stack's data folder


def user_agent(env: Mapping[str, str], token: str | None) -> str:
    """Our identifying User-Agent with img2dataset's ``--user_agent_token`` appended."""
    base = env.get("CRAWL_USER_AGENT", "").strip() or DEFAULT_USER_AGENT
    return f"{base} {token}" if token else base


def crawler_env(options: CrawlOptions, env: Mapping[str, str], state_dir: Path) -> dict[str, str]:
    """What the embedded monitor and workers get beyond the stack's addresses."""
    extra = {"TARGET_RESOLUTION": str(options.image_size),
             "CRAWL_USER_AGENT": user_agent(env, options.user_agent_token)}
    if not env.get("SOURCES_URL", "").strip():
        state_dir.mkdir(parents=True, exist_ok=True)
        sources = state_dir / "sources.json"
        sources.write_text(EMPTY_SOURCES)
        extra["SOURCES_URL"] = str(sources)
    if not env.get("ROBOTS_UNAVAILABLE_GIVE_UP", "").strip():
        extra["ROBOTS_UNAVAILABLE_GIVE_UP"] = str(ROBOTS_GIVE_UP_SECONDS)
    return extra


def processes_env(shell: Mapping[str, str], servers: Mapping[str, str], crawler: Mapping[str, str],
                  monitor_port: int, thumbnails: Path) -> dict[str, str]:
    """The environment of the embedded monitor and workers: the local stack's settings
    (``LOCAL_ENV``) unless the user's own say otherwise (``LISTEN_HOST=0.0.0.0`` to reach the
    dashboard from another machine), then the stack's addresses and this command's settings."""
    return {**LOCAL_ENV, **shell, **servers, "MONITOR_PORT": str(monitor_port), "PYTHONUNBUFFERED": "1",
            **crawler, "THUMBNAIL_DIR": str(thumbnails.resolve())}


class Child:
    """One crawler process, its output in a log file."""

    def __init__(self, name: str, module: str, env: Mapping[str, str], log_path: Path):
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", module], env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, preexec_fn=own_group_dying_with_parent, close_fds=True)

    def exited(self) -> int | None:
        return self.process.poll()

    def signal_group(self, signum: int) -> None:
        _signal_group(self.process.pid, signum)


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass


def stop_children(children: list[Child], grace: float) -> None:
    """SIGTERM each child's group, wait up to ``grace``, SIGKILL whatever is left of them."""
    for child in children:
        if child.exited() is None:
            child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        child.signal_group(signal.SIGKILL)  # a straggler, or what it left behind in its group
        try:
            child.process.wait(10)
        except subprocess.TimeoutExpired:
            pass


class LocalCrawl:
    """The stack, a monitor and ``workers`` workers; ``stop`` ends them all (idempotent)."""

    def __init__(self, data_dir: Path, log_dir: Path, workers: int, crawler_env: Mapping[str, str]):
        self.data_dir = data_dir
        self.log_dir = log_dir
        self.workers = workers
        self._crawler_env = dict(crawler_env)
        self.stack = LocalStack(data_dir, s3=False)
        self.env: dict[str, str] = {}
        self.children: list[Child] = []

    def start_stack(self) -> dict[str, str]:
        """The servers, on free ports; returns the environment the crawler's processes (and this
        one's clients) use. Kafka and Redis start empty (a run never reads an earlier run's
        messages); the thumbnails' folder keeps those a resumed collector reads again."""
        addresses = self.stack.start()
        self.env = processes_env(os.environ, addresses.servers(), self._crawler_env, free_port(),
                                 self.data_dir / THUMBNAILS)
        return self.env

    def start_crawler(self) -> None:
        self.children.append(Child("monitor", MONITOR_MODULE, self.env, self.log_dir / "monitor.log"))
        for n in range(1, self.workers + 1):  # each its share of urls: no group join to wait for
            env = {**self.env, "URL_PARTITION_SHARE": f"{n - 1}/{self.workers}"}
            self.children.append(Child(f"worker-{n}", WORKER_MODULE, env, self.log_dir / f"worker-{n}.log"))

    def died(self) -> Child | None:
        """A child that exited although nobody stopped it."""
        return next((child for child in self.children if child.exited() is not None), None)

    def discard_data(self) -> None:
        """The servers' data and the thumbnails' folder (what a crash left in it), once the crawl is
        complete; their logs stay."""
        for entry in self.data_dir.iterdir() if self.data_dir.is_dir() else []:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)

    def stop(self) -> None:
        """The monitor and workers at once (a worker parks what it holds in Kafka, which the
        monitor is not needed for), then the servers killed: Kafka and Redis hold memory only,
        fresh each run, and tansu would take its whole grace to answer a SIGTERM."""
        children, self.children = self.children, []
        stop_children(children, STOP_GRACE)
        servers, self.stack.servers = self.stack.servers, []
        for server in servers:
            if server.process is not None:
                _signal_group(server.process.pid, signal.SIGKILL)
        for server in servers:
            if server.process is None:
                continue
            try:
                server.process.wait(10)
            except subprocess.TimeoutExpired:
                pass
            server.process = None
