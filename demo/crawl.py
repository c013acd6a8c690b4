"""One crawl of a simulated web by the real processes: the shape shared by the demo,
the end-to-end tests and the benchmark, so they all exercise the same path.
"""
from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path
from collections.abc import Iterator, Mapping

from demo.cluster import Cluster
from demo.outcomes import Outcomes
from devstack.servers import free_port
from demo.simweb import Planned, SimWeb, write_tsv


def crawler_env(base: Mapping[str, str], sources_file: Path, **extra: str) -> dict[str, str]:
    """The stack's settings plus the sources list; loopback allowed, since the web is on
    127.0.0.1; the monitor's dashboard on a free port, so parallel runs do not collide."""
    return {"CRAWL_ALLOW_PRIVATE_NETWORKS": "true", "PYTHONUNBUFFERED": "1",
            "MONITOR_PORT": str(free_port()), **base, "SOURCES_URL": str(sources_file), **extra}


@contextmanager
def crawl(web: SimWeb, plan: list[Planned], base_env: Mapping[str, str], work_dir: Path,
          workers: int = 2, worker_module: str = "worker", url_list: Path | None = None,
          **extra_env: str) -> Iterator[tuple[Cluster, Outcomes]]:
    """Serve ``web``, start a monitor and ``workers`` workers, schedule ``plan`` through the
    TSV producer (or ``url_list``, the plan's URLs by the sites' fixed ports, through the
    list producer); yield while the caller follows (or disturbs) the crawl; stop everything."""
    work_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        stack.enter_context(web.serving())
        sources = work_dir / "sources.json"
        if url_list is None:
            web.write_sources(sources)
        else:  # a list's sites are rated by their counts in it, so the catalog names none of them
            sources.write_text(json.dumps([{"source_name": "unrelated", "image_count": 5000}]))
        env = crawler_env(base_env, sources, **extra_env)
        outcomes = stack.enter_context(Outcomes(env["KAFKA_HOSTS"], [p.uuid for p in plan]))
        cluster = stack.enter_context(Cluster(env, work_dir, worker_module))
        cluster.start(workers)
        if url_list is None:
            cluster.schedule(write_tsv(web, plan, work_dir / "urls.tsv"))
        else:
            cluster.produce_list(url_list)
        yield cluster, outcomes
