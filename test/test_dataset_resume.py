"""Resume after a crash at any step (url_lists.dataset.collector): no row lost, none written twice.

The collector's durable steps (a journal synced, the offsets saved, each file of a shard
renamed into place) are wrapped so that the output folder is copied just before and just
after each: each copy is what a SIGKILL at that instant leaves (what was not written to a
file yet is lost with the process). A new collector is then run on each copy, as the one
command's rerun would: the rows it reports finished are not produced again, the others are
crawled again (a new outcome each), and the broker still holds every earlier outcome.
"""
from __future__ import annotations

import itertools
import json
import shutil
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from common.settings import Settings
from test.dataset_fakes import RUN, FakeLimits, FakeOutcomes, FakeThumbnails, error, link_rot, success, write_list
from url_lists.dataset import collector as collector_module
from url_lists.dataset import writers
from url_lists.dataset.collector import Collector, DatasetOptions
from url_lists.dataset.journal import Journal
from url_lists.dataset.inputs import read_input_shard

PER_SHARD = 4
ROWS = 10
BAD = {2: "no url"}


def crawl_outcome(outcomes: FakeOutcomes, thumbnails: FakeThumbnails, row: int) -> None:
    """Each row's outcome, the same whenever it is crawled."""
    if row in BAD:
        return
    if row % 5 == 0:
        link_rot(outcomes, row)
    elif row % 7 == 0:
        error(outcomes, row, "HTTP 500", 500)
    else:
        success(outcomes, thumbnails, row, exif={"0x10f": f"cam{row}"} if row % 3 == 0 else None)


def expected_status(row: int) -> str:
    return "error" if row in BAD else "link_rot" if row % 5 == 0 else "error" if row % 7 == 0 else "success"


def new_collector(folder: Path, outcomes: FakeOutcomes, thumbnails: FakeThumbnails, fmt: str) -> Collector:
    options = DatasetOptions(folder=folder, output_format=fmt, per_shard=PER_SHARD, image_size=640, run=RUN)
    return Collector(options, Settings(), outcomes=outcomes, thumbnails=thumbnails, limits=FakeLimits())


def run_to_end(c: Collector, shards: list[int]) -> None:
    for shard in shards:
        c.expect(shard)
    c.no_more_shards()
    stop = threading.Event()
    thread = threading.Thread(target=c.run, args=(stop,))
    thread.start()
    thread.join(30)
    if thread.is_alive():
        stop.set()
        thread.join()
        pytest.fail("the collector did not finish")


class Trickle(FakeOutcomes):
    """A few messages a poll, so syncs and publications fall between outcomes."""

    def poll(self, max_messages: int, timeout: float) -> Any:
        time.sleep(0.03)
        return super().poll(2, timeout)


def snapshots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str) -> tuple[list[Path], FakeOutcomes,
                                                                                      FakeThumbnails]:
    folder = tmp_path / "out"
    shards = write_list(folder, ROWS, PER_SHARD, BAD)
    outcomes, thumbnails = Trickle(), FakeThumbnails()
    # Shard 0's row 3 comes last, so shard 0 stays open (journaled) while the others complete.
    for row in [r for r in range(ROWS) if r != 3] + [3, 6, 1]:  # and two repeated
        crawl_outcome(outcomes, thumbnails, row)
    taken: list[Path] = []
    counter = itertools.count()

    def snap(label: str) -> None:
        target = tmp_path / "snapshots" / f"{next(counter):03d}-{label}"
        shutil.copytree(folder, target, ignore_dangling_symlinks=True,
                        copy_function=lambda src, dst: shutil.copyfile(src, dst) if Path(src).exists() else None)
        taken.append(target)

    def around(label: str, original: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            snap(f"before-{label}")
            result = original(*args, **kwargs)
            snap(f"after-{label}")
            return result
        return wrapped

    monkeypatch.setattr(collector_module, "SYNC_INTERVAL", 0.0)
    monkeypatch.setattr(Journal, "sync", around("journal-sync", Journal.sync))
    monkeypatch.setattr(Collector, "save_offsets", around("offsets", Collector.save_offsets))
    monkeypatch.setattr(writers, "publish", around("rename", writers.publish))
    run_to_end(new_collector(folder, outcomes, thumbnails, fmt), shards)
    monkeypatch.undo()
    return taken, outcomes, thumbnails


def check_dataset(folder: Path, fmt: str, thumbnails: FakeThumbnails) -> None:
    seen: list[str] = []
    for shard in range(3):
        input_rows = read_input_shard(folder, shard).column("key").to_pylist()
        table = pq.read_table(folder / f"{shard:05d}.parquet").to_pylist()
        keys = [row["key"] for row in table]
        assert sorted(keys) == sorted(input_rows), f"shard {shard}: every row once"
        seen += keys
        successes = sorted(row["key"] for row in table if row["status"] == "success")
        if fmt == "webdataset":
            with tarfile.open(folder / f"{shard:05d}.tar") as tar:
                images = [name[:-4] for name in tar.getnames() if name.endswith(".jpg")]
            assert sorted(images) == successes, f"shard {shard}: one image per success"
        for row in table:
            number = shard * PER_SHARD + int(row["key"][5:])
            assert row["status"] == expected_status(number), row
            if number % 3 == 0 and row["status"] == "success":
                assert row["exif"] == f'{{"0x10f": "cam{number}"}}'
    assert len(seen) == len(set(seen)) == ROWS
    stats = json.loads((folder / "stats.json").read_text())
    totals = stats["totals"]
    assert totals["rows"] == ROWS
    assert totals["successes"] + totals["link_rot"] + totals["errors"] == ROWS
    assert totals["bad_rows"] == len(BAD)


@pytest.mark.parametrize("fmt", ["webdataset", "parquet"])
def test_a_rerun_after_a_crash_at_any_step_writes_every_row_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 fmt: str) -> None:
    taken, outcomes, thumbnails = snapshots(tmp_path, monkeypatch, fmt)
    labels = {path.name.split("-", 1)[1] for path in taken}
    assert len(taken) >= 15
    assert {"before-journal-sync", "after-journal-sync", "before-offsets", "after-offsets", "before-rename",
            "after-rename"} <= labels
    check_dataset(tmp_path / "out", fmt, thumbnails)
    journaled = [s.name for s in taken if any(p.read_bytes() for p in (s / "_crawl" / "journal").glob("*.jsonl"))]
    assert len(journaled) >= 5, journaled  # crashes with rows only in a journal are among them
    for snapshot in taken:
        again = FakeOutcomes()
        again.logs = {name: list(log) for name, log in outcomes.logs.items()}  # the broker keeps them
        c = new_collector(snapshot, again, thumbnails, fmt)
        finished = c.finished_rows()
        for row in range(ROWS):
            if row not in finished:
                crawl_outcome(again, thumbnails, row)  # produced and crawled again
        run_to_end(c, [0, 1, 2])
        check_dataset(snapshot, fmt, thumbnails)
        leftovers = [p.name for p in snapshot.iterdir() if p.name.startswith(".")]
        assert not leftovers, f"{snapshot.name}: {leftovers}"
