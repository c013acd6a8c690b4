"""``python -m worker``: one crawl worker; run any number on any number of machines.

With ``WORKER_METRICS_PORT`` set it serves ``/metrics`` (``worker.metrics``).
The worker joins its consumer group first and loads the rest meanwhile
(``worker.intake.group_join``); ``worker.service`` wires and runs it.
"""
from __future__ import annotations

import asyncio
import resource

from common.settings import load_settings
from worker import metrics
from worker.intake.group_join import start_joining


def main() -> None:
    settings = load_settings()
    _raise_open_files_limit()
    # First: a port that cannot be had stops the worker before it joins the group.
    metrics_server = (metrics.MetricsServer(settings.worker_metrics_port, settings.listen_host)
                      if settings.worker_metrics_port is not None else None)
    joining = start_joining(settings)
    from worker.service import run  # the image, HTTP and S3 libraries load while the group forms
    asyncio.run(run(settings, metrics_server, joining))


def _raise_open_files_limit() -> None:
    """Each task in flight holds a socket and a shared-memory segment, and idle keep-alive
    connections are kept: MAX_TASKS=500 needs more than the usual soft limit of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


if __name__ == "__main__":
    main()
