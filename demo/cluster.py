"""The crawler's own processes, run as the README says: ``python -m crawl_monitor``,
``python -m worker`` and the TSV producer, each a subprocess.

The demo, the end-to-end tests and the benchmark all start the system this
way, so what the tests prove is what an operator runs. Every child gets its
own process group and a parent-death signal (the dev stack's recipe): Ctrl-C,
SIGTERM, a failed assertion or a SIGKILLed parent leave nothing behind.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from common.process import own_group_dying_with_parent

STOP_GRACE = 15.0  # a worker drains its in-flight fetches on SIGTERM; then it is killed
PRODUCER_TIMEOUT = 180.0


@dataclass
class Child:
    """One crawler process, its stdout and stderr in ``log_path``."""

    name: str
    argv: list[str]
    env: Mapping[str, str]
    log_path: Path
    process: subprocess.Popen | None = field(default=None, repr=False)
    stopped: bool = False  # stopped on purpose: its exit is not a death

    def start(self) -> Child:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.argv, env=dict(self.env), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, preexec_fn=own_group_dying_with_parent, close_fds=True)
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def send(self, signum: int) -> None:
        """SIGKILL takes the whole process group, as a crashed machine would; any other
        signal goes to the process alone, as an orchestrator sends it (its pool is its own)."""
        if self.process is None:
            return
        try:
            if signum == signal.SIGKILL:
                os.killpg(self.pid, signum)
            elif self.alive():
                self.process.send_signal(signum)
        except ProcessLookupError:
            pass

    def stop(self, signum: int = signal.SIGTERM, timeout: float = STOP_GRACE) -> int | None:
        """Stop it on purpose (a fault test's SIGKILL, say); returns its exit code. Whatever
        it leaves behind in its group is killed."""
        self.stopped = True
        self.send(signum)
        code = self.wait(timeout)
        self.send(signal.SIGKILL)
        return code if code is not None else self.wait(10)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.process.wait(timeout) if self.process else None
        except subprocess.TimeoutExpired:
            return None

    def logged(self, event: str, timeout: float) -> dict[str, Any]:
        """The first JSON line of its log with this ``event`` (``worker_metrics_started``, say),
        waiting up to ``timeout`` s for it; TimeoutError if it never came."""
        deadline = time.monotonic() + timeout
        while True:
            if self.log_path.exists():
                for line in self.log_path.read_text(errors="replace").splitlines():
                    if f'"{event}"' in line:
                        try:
                            record = json.loads(line)
                        except ValueError:
                            continue
                        if record.get("event") == event:
                            return record
            if time.monotonic() >= deadline or (self.process is not None and self.process.poll() is not None):
                raise TimeoutError(f"{self.name} logged no {event} (see {self.log_path})")
            time.sleep(0.1)


def module_argv(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


class Cluster:
    """A monitor and any number of workers on one stack; a context manager that stops them all."""

    def __init__(self, env: Mapping[str, str], log_dir: Path, worker_module: str = "worker"):
        """``worker_module``: what ``python -m`` runs as a worker (``test.resolving_worker``:
        a worker whose host names come from a hosts file)."""
        self.env = dict(env)
        self.log_dir = log_dir
        self.worker_module = worker_module
        self.children: list[Child] = []
        self._workers = 0

    def _start(self, name: str, module: str) -> Child:
        child = Child(name, module_argv(module), self.env, self.log_dir / f"{name}.log").start()
        self.children.append(child)
        return child

    def start_monitor(self) -> Child:
        return self._start("monitor", "crawl_monitor")

    def start_worker(self) -> Child:
        self._workers += 1
        return self._start(f"worker-{self._workers}", self.worker_module)

    def start(self, workers: int = 2) -> Cluster:
        self.start_monitor()
        for _ in range(workers):
            self.start_worker()
        return self

    def schedule(self, tsv: Path) -> None:
        """Run the TSV producer to completion; its output joins the logs."""
        with open(self.log_dir / "tsv_producer.log", "ab") as log:
            subprocess.run(module_argv("url_lists.tsv_producer", str(tsv), self.env["KAFKA_HOSTS"]),
                           env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           preexec_fn=own_group_dying_with_parent, timeout=PRODUCER_TIMEOUT, check=True)

    def produce_list(self, url_list: Path) -> None:
        """Run the list producer on ``url_list`` to completion (sources by site, counted)."""
        with open(self.log_dir / "list_producer.log", "ab") as log:
            subprocess.run(module_argv("url_lists.list_producer", str(url_list), "--progress-file",
                                       str(self.log_dir / "list_progress.json")),
                           env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           preexec_fn=own_group_dying_with_parent, timeout=PRODUCER_TIMEOUT, check=True)

    def died(self) -> list[Child]:
        """Children that exited although nobody stopped them."""
        return [c for c in self.children
                if not c.stopped and c.process is not None and c.process.poll() is not None]

    @staticmethod
    def stop_children(children: list[Child], grace: float = STOP_GRACE) -> dict[str, int | None]:
        """SIGTERM them all at once, wait ``grace``, SIGKILL what is left; exit codes by name."""
        for child in children:
            child.stopped = True
            child.send(signal.SIGTERM)
        deadline = time.monotonic() + grace
        codes = {}
        for child in children:
            code = child.wait(max(0.0, deadline - time.monotonic()))
            child.send(signal.SIGKILL)  # the stragglers, or what it left behind
            codes[child.name] = code if code is not None else child.wait(10)
        return codes

    def stop(self) -> dict[str, int | None]:
        codes = self.stop_children([c for c in self.children if c.process is not None])
        self.children.clear()
        return codes

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
