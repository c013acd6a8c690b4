"""Child processes that do not outlive their parent."""
from __future__ import annotations

import ctypes
import os
import signal
import sys

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
