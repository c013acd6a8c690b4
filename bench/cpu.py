"""CPU time and memory of other processes, for benchmarks that run their peers and servers beside them
(from /proc: psutil is not a dependency)."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

BUSY_BIN = 10.0  # seconds per figure of KindSampler's cores-busy profile


def stat_cpu(stat: Path, reaped_children: bool = False) -> float:
    """utime+stime from a /proc ``stat`` file (a process's or one thread's), in seconds; with
    ``reaped_children``, also the CPU of the children it has waited for."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15 if reaped_children else 13]) / os.sysconf("SC_CLK_TCK")


def proc_cpu(pids: list[int]) -> float:
    """utime+stime (and reaped children's) of running processes, in seconds, from /proc."""
    return sum(stat_cpu(Path(f"/proc/{pid}/stat"), reaped_children=True) for pid in pids)


def proc_rss_and_files(pid: int) -> tuple[int, int]:
    """Resident bytes and open files of a process and its descendants (a worker's pool)."""
    rss = files = 0
    for member in _tree(pid):
        try:
            status = Path(f"/proc/{member}/status").read_text()
            rss += next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:"))
            files += len(os.listdir(f"/proc/{member}/fd"))
        except (OSError, StopIteration):  # it exited in between
            continue
    return rss, files


def _tree(pid: int, skip: frozenset[int] = frozenset()) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        if current in skip:
            continue
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo += [int(child) for child in task.read_text().split()]
            except OSError:
                continue
    return found


def tree_cpu(pid: int) -> float:
    """utime+stime of a process and its descendants (a worker's image pool, those it reaped
    included), in seconds."""
    total = 0.0
    for member in _tree(pid):
        try:
            total += stat_cpu(Path(f"/proc/{member}/stat"), reaped_children=True)
        except OSError:
            continue
    return total


class TreeSampler:
    """Peak resident memory and CPU of named process trees, read from /proc every ``every`` s
    on a thread of its own, so that a peak between the benchmark's own checks is not missed.

    CPU counts from ``mark_cpu()``; the last sample of a tree that exits stays (its CPU
    is not lost when the monitor is stopped before the others)."""

    def __init__(self, pids: Mapping[str, int], every: float = 1.0):
        self.pids = dict(pids)
        self.every = every
        self.peak_rss: dict[str, int] = {}
        self._cpu: dict[str, float] = {}
        self._cpu_from: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-sampler", daemon=True)

    def start(self) -> TreeSampler:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def sample(self) -> None:
        for name, pid in self.pids.items():
            if not Path(f"/proc/{pid}").exists():
                continue
            rss, _files = proc_rss_and_files(pid)
            cpu = tree_cpu(pid)
            with self._lock:
                self.peak_rss[name] = max(rss, self.peak_rss.get(name, 0))
                self._cpu[name] = max(cpu, self._cpu.get(name, 0.0))

    def mark_cpu(self) -> None:
        """CPU is counted from now on."""
        self.sample()
        with self._lock:
            self._cpu_from = dict(self._cpu)

    def cpu(self) -> dict[str, float]:
        """CPU seconds of each tree since ``mark_cpu()``."""
        with self._lock:
            return {name: seconds - self._cpu_from.get(name, 0.0) for name, seconds in self._cpu.items()}


EXEC_GRACE_SECONDS = 1.0  # a child younger than this with its parent's command line may not have exec'd yet


def process_kind(pid: int) -> str:
    """What a process of a command is, from its command line (the list reader's pool processes,
    spawned by the command, are the command's; other spawned processes are a worker's image pool).
    A child caught between its fork and its exec still shows its parent's command line (an
    image process read as a worker): while young, it is "other", which KindSampler reads again."""
    try:
        line = _command_line(pid)
        parent, started = _parent_and_start(pid)
        if time.clock_gettime(time.CLOCK_BOOTTIME) - started < EXEC_GRACE_SECONDS and line == _command_line(parent):
            return "other"
    except OSError:
        return "gone"
    if b"multiprocessing" in line:
        try:
            spawner = _command_line(parent)
        except OSError:
            spawner = b""
        return "command" if b"url_lists" in spawner else "image pool"
    for marker, kind in ((b"-m worker", "workers"),
                         (b"resolving_worker", "workers"),
                         (b"tansu", "tansu"), (b"valkey", "valkey"), (b"redis", "valkey"),
                         (b"crawl_monitor", "monitor"), (b"weed", "seaweedfs"), (b"url_lists", "command"),
                         (b"img2dataset", "command")):
        if marker in line:
            return kind
    return "other"


def _command_line(pid: int) -> bytes:
    return b" ".join(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))


def _parent_and_start(pid: int) -> tuple[int, float]:
    """The parent's pid and when the process started (seconds since boot), from its ``stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[19]) / os.sysconf("SC_CLK_TCK")


class KindSampler:
    """Each process's own CPU under a command, read from /proc every 0.5 s, by kind, from the
    sampler's start; the last sample of a process that exits stays (up to 0.5 s of its CPU is missed)."""

    def __init__(self, pid: int, skip: frozenset[int] = frozenset(), root_kind: str = "command"):
        self.pid, self._last, self._kinds = pid, {}, {}  # type: ignore[var-annotated]
        self._root_kind = root_kind
        self._skip = skip  # processes not counted (and not their children): the simulated web
        self._started = time.monotonic()
        self._totals: list[tuple[float, float]] = []  # (seconds since start, the tree's CPU seconds so far)
        self._base: dict[int, float] = {}  # what the processes already running had used: not counted
        for member in _tree(pid, skip):
            with contextlib.suppress(OSError, IndexError):
                self._base[member] = stat_cpu(Path(f"/proc/{member}/stat"))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for member in _tree(self.pid, self._skip):
                with contextlib.suppress(OSError, IndexError):
                    self._last[member] = stat_cpu(Path(f"/proc/{member}/stat"))
                    if self._kinds.get(member, "other") == "other":  # read again: it may not have exec'd yet
                        self._kinds[member] = self._root_kind if member == self.pid else process_kind(member)
            self._totals.append((time.monotonic() - self._started, sum(self._last.values())))

    def busy(self) -> list[float]:
        """Cores busy in each BUSY_BIN seconds, from the samples (a bin's CPU over its length)."""
        profile, edge, before = [], BUSY_BIN, 0.0
        for at, total in self._totals:
            if at >= edge:
                profile.append((total - before) / BUSY_BIN)
                edge, before = edge + BUSY_BIN, total
        return profile

    def split(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        kinds: dict[str, float] = {}
        for member, seconds in self._last.items():
            kinds[self._kinds[member]] = kinds.get(self._kinds[member], 0.0) + seconds - self._base.get(member, 0.0)
        return kinds


def per_image_by_kind(split: Mapping[str, float], images: int) -> str:
    """A ``KindSampler.split`` as CPU ms an image by process kind, the largest first."""
    return ", ".join(f"{kind} {seconds / max(1, images) * 1000:.2f}"
                     for kind, seconds in sorted(split.items(), key=lambda item: -item[1]))
