"""CPU time and memory of other processes, for benchmarks that run their peers and servers beside them."""
from __future__ import annotations

import os
from pathlib import Path


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


def _tree(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo += [int(child) for child in task.read_text().split()]
            except OSError:
                continue
    return found
