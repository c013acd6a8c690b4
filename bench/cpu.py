"""CPU time of other processes, for benchmarks that run their peers and servers beside them."""
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
