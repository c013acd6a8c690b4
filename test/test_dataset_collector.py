"""The collector (url_lists.dataset.collector) with small fakes for Kafka, S3 and Redis."""
from __future__ import annotations

import io
import json
import tarfile
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from common import contracts
from common.settings import Settings
from test.dataset_fakes import (RUN, FakeLimits, FakeOutcomes, FakeThumbnails, error, link_rot, success,
                                write_list)
from url_lists.dataset import collector as collector_module
from url_lists.dataset.collector import Collector, DatasetOptions
from url_lists.dataset.keys import row_identifier

PER_SHARD = 4


def collector(folder: Path, outcomes: FakeOutcomes, thumbnails: FakeThumbnails, fmt: str = "webdataset",
              limits: FakeLimits | None = None) -> Collector:
    options = DatasetOptions(folder=folder, output_format=fmt, per_shard=PER_SHARD, image_size=640, run=RUN)
    return Collector(options, Settings(), outcomes=outcomes, thumbnails=thumbnails, limits=limits or FakeLimits())


def run(c: Collector, shards: list[int], timeout: float = 20.0) -> None:
    for shard in shards:
        c.expect(shard)
    c.no_more_shards()
    stop = threading.Event()
    thread = threading.Thread(target=c.run, args=(stop,))
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        stop.set()
        thread.join()
        pytest.fail("the collector did not finish")


def the_crawl(outcomes: FakeOutcomes, thumbnails: FakeThumbnails) -> None:
    """Rows 0-9 of a 10-row list (row 2 bad): successes, link rot, errors, in no particular order, some twice."""
    success(outcomes, thumbnails, 9, exif={"0x10f": "Canon"})
    error(outcomes, 6, "HTTP 403", 403)
    success(outcomes, thumbnails, 0)
    link_rot(outcomes, 5)
    success(outcomes, thumbnails, 1, tags=["noimageindex"])      # the site forbids the image
    success(outcomes, None, 3)                                  # no thumbnail in the store
    success(outcomes, thumbnails, 4)
    error(outcomes, 7, "Timeout", None)
    success(outcomes, thumbnails, 8)
    success(outcomes, thumbnails, 0)                            # again: at-least-once
    error(outcomes, 0, "Timeout", None)                         # a later, different outcome: the first counts
    success(outcomes, thumbnails, 1, run=__import__("uuid").UUID(int=RUN.int ^ (1 << 100)))  # another run's
    outcomes.add(contracts.METADATA_TOPIC, {"identifier": row_identifier(RUN, 4), "unknown": True})
    outcomes.add(contracts.CRAWL_ERRORS_TOPIC, {"no identifier": 1})
    outcomes.logs[f"{contracts.LINK_ROT_TOPIC}:0"].append(b"\xff not json")


def test_a_crawl_becomes_webdataset_shards(tmp_path: Path) -> None:
    outcomes, thumbnails = FakeOutcomes(), FakeThumbnails()
    shards = write_list(tmp_path, 10, PER_SHARD, bad={2: "url must be a non-empty string"})
    the_crawl(outcomes, thumbnails)
    c = collector(tmp_path, outcomes, thumbnails)
    run(c, shards)

    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(("_", "."))) == [
        "00000.parquet", "00000.tar", "00000_stats.json", "00001.parquet", "00001.tar", "00001_stats.json",
        "00002.parquet", "00002.tar", "00002_stats.json", "stats.json"]
    rows = {}
    for shard in shards:
        for row in pq.read_table(tmp_path / f"{shard:05d}.parquet").to_pylist():
            rows[row["key"]] = row
    assert len(rows) == 10
    assert rows["000000000"]["status"] == "success" and rows["000000000"]["caption"] == "caption 0"
    assert rows["000000000"]["license"] == "lic0" and rows["000000000"]["width"] == 800
    assert rows["000000001"]["status"] == "error" and rows["000000001"]["error_message"] == "XRobotsTagForbidsImage"
    assert rows["000000002"]["status"] == "error" and rows["000000002"]["error_message"].startswith("url must")
    assert rows["000000003"]["error_message"] == "ThumbnailMissing"
    assert rows["000010001"]["status"] == "link_rot"
    assert (rows["000010002"]["error_message"], rows["000010002"]["http_status"]) == ("HTTP 403", 403)
    assert json.loads(rows["000020001"]["exif"]) == {"0x10f": "Canon"}

    with tarfile.open(tmp_path / "00000.tar") as tar:
        names = tar.getnames()
        assert names == ["000000000.jpg", "000000000.txt", "000000000.json"]
        assert tar.extractfile("000000000.txt").read() == b"caption 0"  # type: ignore[union-attr]
        meta = json.loads(tar.extractfile("000000000.json").read())  # type: ignore[union-attr]
        assert meta["key"] == "000000000" and meta["url"] == "http://site0.test/0.jpg"
        image = tar.extractfile("000000000.jpg").read()  # type: ignore[union-attr]
        assert image == thumbnails.objects[row_identifier(RUN, 0)]  # byte for byte: not re-encoded

    shard_stats = json.loads((tmp_path / "00001_stats.json").read_text())
    assert (shard_stats["count"], shard_stats["successes"], shard_stats["failed_to_download"]) == (4, 1, 3)
    summary = json.loads((tmp_path / "stats.json").read_text())
    totals = summary["totals"]
    assert (totals["rows"], totals["successes"], totals["link_rot"], totals["errors"], totals["bad_rows"]) == (
        10, 4, 1, 5, 1)
    assert totals["bad"] == [{"file": "list.parquet", "row": 3, "reason": "url must be a non-empty string"}]
    assert totals["by_http_status"] == {"403": 1}
    assert totals["failures_by_site"] == {"site0.test": 2, "site1.test": 2, "site2.test": 1}  # bad rows: none
    assert summary["rows_read"] == 10
    progress = c.progress()
    assert (progress.rows_expected, progress.outcomes, progress.successes) == (10, 10, 4)
    lines = c.summary_lines()
    assert any("bad row: list.parquet row 3" in line for line in lines)
    assert not list((tmp_path / "_crawl" / "journal").glob("*.jsonl"))
    assert c.finished_rows() == set(range(10))


@pytest.mark.parametrize("fmt", ["webdataset", "parquet", "files"])
def test_the_other_formats_and_data_synced_as_it_comes(tmp_path: Path, fmt: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collector_module, "DATA_SYNC_BYTES", 1)
    monkeypatch.setattr(collector_module, "SYNC_INTERVAL", 0.0)
    outcomes, thumbnails = FakeOutcomes(), FakeThumbnails()
    shards = write_list(tmp_path, 10, PER_SHARD, bad={2: "no url"})
    the_crawl(outcomes, thumbnails)
    run(collector(tmp_path, outcomes, thumbnails, fmt), shards)
    table = pq.read_table(tmp_path / "00000.parquet")
    assert table.num_rows == 4
    if fmt == "parquet":
        by_key = {r["key"]: r for r in table.to_pylist()}
        assert by_key["000000000"]["jpg"] == thumbnails.objects[row_identifier(RUN, 0)]
        assert by_key["000000002"]["jpg"] is None
        assert not (tmp_path / "00000.tar").exists()
    elif fmt == "webdataset":
        with tarfile.open(tmp_path / "00000.tar") as tar:
            assert tar.getnames() == ["000000000.jpg", "000000000.txt", "000000000.json"]
    else:
        files = sorted(p.name for p in (tmp_path / "00000").iterdir())
        assert files == ["000000000.jpg", "000000000.json", "000000000.txt"]
        assert (tmp_path / "00000" / "000000000.jpg").read_bytes() == thumbnails.objects[row_identifier(RUN, 0)]


def test_a_shard_waits_for_its_last_row(tmp_path: Path) -> None:
    outcomes, thumbnails = FakeOutcomes(), FakeThumbnails()
    shards = write_list(tmp_path, 4, PER_SHARD)
    for row in (0, 1, 2):
        success(outcomes, thumbnails, row)
    c = collector(tmp_path, outcomes, thumbnails)
    for shard in shards:
        c.expect(shard)
    c.no_more_shards()
    stop = threading.Event()
    thread = threading.Thread(target=c.run, args=(stop,))
    thread.start()
    thread.join(1.5)
    assert thread.is_alive() and not (tmp_path / "00000.tar").exists()
    assert c.progress().outcomes == 3
    link_rot(outcomes, 3)
    thread.join(10)
    assert not thread.is_alive()
    assert (tmp_path / "00000_stats.json").exists()


def test_an_unknown_outcome_topic_or_field_does_not_stop_it(tmp_path: Path) -> None:
    """Another part of the crawler may add an outcome and fields."""
    outcomes, thumbnails = FakeOutcomes(), FakeThumbnails()
    shards = write_list(tmp_path, 2, PER_SHARD)
    success(outcomes, thumbnails, 0, consent="given", robots_wait_since=1.0e9)
    outcomes.add("some_new_outcome", {"identifier": row_identifier(RUN, 1), "reason": "why"}, 0)
    run(collector(tmp_path, outcomes, thumbnails), shards)
    rows = {r["key"]: r for r in pq.read_table(tmp_path / "00000.parquet").to_pylist()}
    assert rows["000000001"]["status"] == "some_new_outcome" and rows["000000001"]["error_message"] == "why"
    summary = json.loads((tmp_path / "stats.json").read_text())
    assert summary["totals"]["other_outcomes"] == {"some_new_outcome": 1}
    assert summary["totals"]["waited_for_robots"] == 1


def test_an_opted_out_row_ends_with_the_signal_and_value_that_decided(tmp_path: Path) -> None:
    outcomes, thumbnails = FakeOutcomes(), FakeThumbnails()
    shards = write_list(tmp_path, 2, PER_SHARD)
    success(outcomes, thumbnails, 0)
    outcomes.add("opted_out", {"identifier": row_identifier(RUN, 1), "url": "http://a.test/x.jpg",
                               "signal": "tdmrep-file", "value": "/photos/* reserved", "status": None,
                               "retry_after_since": 1.0e9}, 0)
    c = collector(tmp_path, outcomes, thumbnails)
    run(c, shards)
    rows = {r["key"]: r for r in pq.read_table(tmp_path / "00000.parquet").to_pylist()}
    assert rows["000000001"]["status"] == "opted_out"
    assert rows["000000001"]["error_message"] == "tdmrep-file: /photos/* reserved"
    summary = json.loads((tmp_path / "stats.json").read_text())
    assert summary["totals"]["opted_out"] == {"tdmrep-file": 1} and summary["totals"]["failures_by_site"] == {}
    assert summary["totals"]["waited_for_retry_after"] == 1
    assert any("opted out by the site" in line and "tdmrep-file 1" in line for line in c.summary_lines())


def test_a_thumbnail_larger_than_the_image_size_is_shrunk(tmp_path: Path) -> None:
    from test.dataset_fakes import jpeg
    from url_lists.dataset.images import jpeg_size
    outcomes, thumbnails = FakeOutcomes(), FakeThumbnails()
    shards = write_list(tmp_path, 1, PER_SHARD)
    success(outcomes, thumbnails, 0)
    thumbnails.objects[row_identifier(RUN, 0)] = jpeg(1000, 500)
    run(collector(tmp_path, outcomes, thumbnails), shards)
    with tarfile.open(tmp_path / "00000.tar") as tar:
        image = tar.extractfile("000000000.jpg").read()  # type: ignore[union-attr]
    assert jpeg_size(image) == (640, 320)
    from PIL import Image
    assert Image.open(io.BytesIO(image)).size == (640, 320)


def test_thumbnails_are_read_from_a_folder_and_deleted_once_their_shard_is_published(tmp_path: Path) -> None:
    """THUMBNAIL_DIR: the files the workers wrote; a missing one is ThumbnailMissing, as in S3;
    a shard's files go once it is published, an open shard's stay (its rebuild reads them)."""
    from worker.imaging.thumbnails import ThumbnailFolder, thumbnail_path

    folder_path = tmp_path / "_crawl" / "thumbnails"
    outcomes, thumbnails = FakeOutcomes(), FakeThumbnails()
    shards = write_list(tmp_path, 10, PER_SHARD, bad={2: "url must be a non-empty string"})
    the_crawl(outcomes, thumbnails)
    success(outcomes, thumbnails, 3 + 2 * PER_SHARD)  # shard 2's row 11... of a 10-row list: not a row
    folder = ThumbnailFolder(folder_path)
    for identifier, image in thumbnails.objects.items():
        thumbnail_path(folder_path, identifier).write_bytes(image)
    stray = thumbnail_path(folder_path, row_identifier(RUN, 11))
    c = Collector(DatasetOptions(folder=tmp_path, output_format="webdataset", per_shard=PER_SHARD, image_size=640,
                                 run=RUN), Settings(thumbnail_dir=str(folder_path)), outcomes=outcomes,
                  limits=FakeLimits())
    run(c, shards)
    rows = {}
    for shard in shards:
        rows.update({row["key"]: row for row in pq.read_table(tmp_path / f"{shard:05d}.parquet").to_pylist()})
    assert rows["000000000"]["status"] == "success"
    assert rows["000000003"]["error_message"] == "ThumbnailMissing"
    with tarfile.open(tmp_path / "00000.tar") as tar:
        image = tar.extractfile("000000000.jpg").read()  # type: ignore[union-attr]
    assert image == thumbnails.objects[row_identifier(RUN, 0)]
    # Every file written into a published shard is gone; row 1's (X-Robots-Tag forbids it: a
    # worker writes none), the other run's and the stray one are not the collector's to delete.
    left = sorted(p.name for p in folder_path.iterdir())
    assert left == sorted(thumbnail_path(folder_path, i).name for i in thumbnails.objects
                          if i not in {row_identifier(RUN, r) for r in (0, 4, 8, 9)})
    assert stray.exists()

    # An open shard (its last row has no outcome yet) keeps its files until it is published.
    outcomes, thumbnails = FakeOutcomes(), FakeThumbnails()
    other = tmp_path / "again"
    shards = write_list(other, 4, PER_SHARD)
    for row in (0, 1, 2):
        success(outcomes, thumbnails, row)
    for identifier, image in thumbnails.objects.items():
        thumbnail_path(folder_path, identifier).write_bytes(image)
    c = Collector(DatasetOptions(folder=other, output_format="webdataset", per_shard=PER_SHARD, image_size=640,
                                 run=RUN), Settings(), outcomes=outcomes, thumbnails=folder, limits=FakeLimits())
    for shard in shards:
        c.expect(shard)
    c.no_more_shards()
    stop = threading.Event()
    thread = threading.Thread(target=c.run, args=(stop,))
    thread.start()
    thread.join(1.5)
    assert thread.is_alive() and c.progress().outcomes == 3
    assert all(thumbnail_path(folder_path, i).exists() for i in thumbnails.objects)
    link_rot(outcomes, 3)
    thread.join(10)
    assert not thread.is_alive() and (other / "00000_stats.json").exists()
    assert not any(thumbnail_path(folder_path, i).exists() for i in thumbnails.objects)
