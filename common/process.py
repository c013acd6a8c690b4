"""Child processes that do not outlive their parent."""
from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import threading

from common.jsonlog import log_event

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies: a SIGKILLed worker must not
    leave its image pool running, nor a SIGKILLed demo its servers. SIGKILL, not SIGTERM:
    with the parent gone nobody waits for a graceful stop. Given ``parent_pid``, exit at
    once if that parent died before the request took effect."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def own_group_dying_with_parent() -> None:
    """``preexec_fn`` for a server or crawler subprocess: a process group of its own (so
    stopping it takes its children too), killed with its parent."""
    os.setsid()
    die_with_parent()


def exit_if_not_stopped_within(seconds: float, event: str) -> threading.Timer:
    """A stop that overruns its own bounds ends the process anyway: after ``seconds`` this logs
    ``event``, writes every thread's stack to stderr (what held it) and exits 1.

    Each step of a graceful stop is bounded, but a blocking client call on a thread (a
    synchronous Kafka commit to a broker that does not answer, say) is not cancelled by
    asyncio's timeouts, and the interpreter joins those threads before it exits: a worker
    once outlived its test's 60 s wait after SIGTERM. A supervisor would SIGKILL it later;
    this says why first. A timer thread, so a busy or blocked event loop cannot hold it."""
    def overdue() -> None:
        log_event(event, seconds=seconds)
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(seconds, overdue)
    timer.daemon = True
    timer.start()
    return timer
