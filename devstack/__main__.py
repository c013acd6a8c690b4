"""``python -m devstack``: run the local stack until Ctrl-C or SIGTERM.

Data lives in ``.devstack/``: Kafka's topics, messages and offsets in the stack's S3,
so restarting the broker (or the whole stack) keeps them; Redis starts empty.
"""
from __future__ import annotations

import signal
import threading
from pathlib import Path

from common.contracts import EVENT_DEVSTACK_READY, EVENT_DEVSTACK_STOPPED, EVENT_DEVSTACK_STOPPING
from common.jsonlog import log_event
from devstack.stack import LocalStack


def main() -> None:
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    data_dir = Path(".devstack")
    with LocalStack(data_dir, durable=True) as addresses:
        log_event(EVENT_DEVSTACK_READY, data_dir=str(data_dir.resolve()), **addresses.environment())
        stop.wait()
        log_event(EVENT_DEVSTACK_STOPPING)
    log_event(EVENT_DEVSTACK_STOPPED)


if __name__ == "__main__":
    main()
