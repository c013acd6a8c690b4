"""The simulated web in a process of its own, so that what the bench process does meanwhile (a
crawler's outcome reader, the sites' request log) never holds a site's answer.

Served from one thread of the bench process, the sites shared its interpreter with the outcome
reader: in this crawler's rounds only (img2dataset's bench process only waits), every site's
answers came 0.6-2 s late for 1-5 s at a time, which the adaptive back-off read, rightly, as load
(docs/decisions.md, "A peer bench on a real-shaped list"). Apart, the web serves both crawlers
the same way: its own process, its own interpreter, nothing else in it. The sites' logs come
back when it stops, as ``SimWeb``'s do (``sites[name].log``).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import os
import json
import resource
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait

from demo.simweb import RequestRecord, SimWeb, SiteSpec

WATCH_SECONDS, LATE_SECONDS = 0.05, 0.1  # the loop's own clock, checked this often; late past this
PRIORITY = -10  # nice: ahead of the crawler's processes for the CPU, as a web on its own machines would be
START_SECONDS = 120.0  # a spawned interpreter, its imports and 1,600 listeners on a busy machine
STOP_SECONDS = 60.0


@dataclass
class SiteLog:
    """A site as the bench reads it after the crawl: its spec and its requests."""

    spec: SiteSpec
    log: list[RequestRecord] = field(default_factory=list)


def _serve(specs: list[SiteSpec], pipe: Connection) -> None:
    """The child: serve until the parent says stop, then send back each site's log, the CPU used
    and the times its loop ran late (nothing else runs in it, so a late loop is the machine)."""
    web = SimWeb(specs)  # logged in memory only: a write to disk may block the loop behind others' writes
    late: list[tuple[float, float]] = []

    async def watch() -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + WATCH_SECONDS
            await asyncio.sleep(WATCH_SECONDS)
            if loop.time() - due > LATE_SECONDS:
                late.append((time.time(), loop.time() - due))

    async def serve() -> None:
        await web.start()
        gc.freeze()  # the sites and their files stay: never walked again
        gc.disable()  # a full collection took up to 0.33 s under this crawler's load: a round's garbage waits
        watching = asyncio.create_task(watch())
        pipe.send("ready")
        stop = asyncio.Event()
        asyncio.get_running_loop().add_reader(pipe.fileno(), stop.set)
        await stop.wait()
        pipe.recv()
        watching.cancel()
        await web.stop()

    collections: list[tuple[float, float]] = []  # (wall clock, seconds) of each full collection
    began = [0.0]

    def timed(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                began[0] = time.perf_counter()
            else:
                collections.append((time.time(), time.perf_counter() - began[0]))

    gc.callbacks.append(timed)
    with contextlib.suppress(OSError):  # root only: the sites are other machines, not the crawler's neighbours
        os.setpriority(os.PRIO_PROCESS, 0, PRIORITY)
    asyncio.run(serve())
    usage = resource.getrusage(resource.RUSAGE_SELF)
    pipe.send(({name: site.log for name, site in web.sites.items()}, usage.ru_utime + usage.ru_stime, late,
               collections))


class WebApart:
    """``SimWeb``'s bench-facing side (``serving``, ``sites``, ``all_requests``), served by a child process.
    ``serving`` may be entered again while serving (``demo.crawl.crawl`` enters it): the inner one
    does nothing, so the caller that started the web decides when it stops."""

    def __init__(self, specs: list[SiteSpec], log_path: Path | None = None):
        self._specs, self._log_path = specs, log_path
        self.sites = {spec.name: SiteLog(spec) for spec in specs}
        self.cpu = 0.0  # the child's CPU seconds, known once it stopped
        self.late: list[tuple[float, float]] = []  # (wall clock, seconds) its loop ran late past LATE_SECONDS
        self.collections: list[tuple[float, float]] = []  # (wall clock, seconds) its full garbage collections
        self._serving = False
        self.pid: int | None = None  # the web's process while it serves

    @contextmanager
    def serving(self) -> Iterator[WebApart]:
        if self._serving:
            yield self
            return
        context = multiprocessing.get_context("spawn")  # no copy of the bench's threads and clients
        ours, theirs = context.Pipe()
        child = context.Process(target=_serve, args=(self._specs, theirs),
                                name="simweb", daemon=True)
        child.start()
        self.pid = child.pid
        try:
            if ours not in wait([ours, child.sentinel], START_SECONDS):
                raise RuntimeError(f"the simulated web did not start (exit code {child.exitcode})")
            ours.recv()
            self._serving = True
            yield self
        finally:
            self._serving = False
            if child.is_alive():
                ours.send("stop")
                if ours.poll(STOP_SECONDS):
                    logs, self.cpu, self.late, self.collections = ours.recv()
                    for name, log in logs.items():
                        self.sites[name].log = log
                    self._write_log()
            child.join(10)
            if child.is_alive():
                child.kill()

    def _write_log(self) -> None:
        """The requests as ``SimWeb`` logs them (one JSON line each, in arrival order), after the crawl."""
        if self._log_path is not None:
            with open(self._log_path, "a") as out:
                out.writelines(json.dumps(asdict(record)) + "\n" for record in self.all_requests())

    def all_requests(self) -> list[RequestRecord]:
        return sorted((r for site in self.sites.values() for r in site.log), key=lambda r: r.time)
