"""CPU time of other processes, for benchmarks that run their peers and servers beside them."""
from __future__ import annotations

import os
from pathlib import Path


def proc_cpu(pids: list[int]) -> float:
    """utime+stime (and reaped children's) of running processes, in seconds, from /proc."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += sum(int(v) for v in fields[11:15])
    return total / os.sysconf("SC_CLK_TCK")
