"""A stop that overruns its bounds ends the process, and says what held it."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from common.contracts import EVENT_WORKER_STOP_OVERDUE

BLOCKED = textwrap.dedent(f"""
    import threading, time
    from common.process import exit_if_not_stopped_within

    def held_by_a_client_call():
        time.sleep(60)  # a blocking call asyncio cannot cancel

    threading.Thread(target=held_by_a_client_call, name="kafka-commit").start()
    exit_if_not_stopped_within(0.5, {EVENT_WORKER_STOP_OVERDUE!r})
    time.sleep(60)
""")


def test_an_overdue_stop_logs_dumps_every_thread_and_exits_1() -> None:
    done = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["event"] == EVENT_WORKER_STOP_OVERDUE and line["seconds"] == 0.5
    assert "held_by_a_client_call" in done.stderr  # the stack of the thread that held it


def test_a_stop_within_its_bounds_is_not_cut_short() -> None:
    script = ("from common.process import exit_if_not_stopped_within\n"
              f"exit_if_not_stopped_within(30, {EVENT_WORKER_STOP_OVERDUE!r})\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and not done.stdout  # a daemon timer: the exit does not wait for it
