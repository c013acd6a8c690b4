"""Shard writers (url_lists.dataset.writers): each format read back; nothing in place before publish."""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from url_lists.dataset.writers import TarMembers, discard_leftovers, extra_columns, row_schema, shard_writer

INPUT = pa.schema([("row", pa.int64()), ("key", pa.string()), ("url", pa.string()), ("caption", pa.string()),
                   ("status", pa.string()), ("bad_reason", pa.string()), ("source_file", pa.string()),
                   ("source_row", pa.int64()), ("license", pa.string()), ("score", pa.float64())])


def rows() -> list[tuple[dict, bytes | None]]:
    out = []
    for n in range(5):
        success = n % 2 == 0
        out.append(({"key": f"00003{n:04d}", "url": f"http://a.test/{n}.jpg", "caption": f"é caption {n}",
                     "license": "cc0", "score": n / 2, "status": "success" if success else "error",
                     "error_message": None if success else "HTTP 403", "http_status": None if success else 403,
                     "width": 10 if success else None, "height": 20 if success else None,
                     "compression_quality": 80 if success else None, "filesize": 99 if success else None,
                     "exif": '{"0x10f": "x"}' if n == 0 else None, "x_robots_tag": ["noai"] if success else None},
                    bytes([n]) * (700 + n) if success else None))
    return out


def write(folder: Path, fmt: str) -> None:
    writer = shard_writer(fmt, folder, 3, row_schema(INPUT))
    for row, image in rows():
        writer.add(row, image)
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == []  # nothing visible yet
    writer.publish({"count": 5})


def test_webdataset(tmp_path: Path) -> None:
    write(tmp_path, "webdataset")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00003.parquet", "00003.tar", "00003_stats.json"]
    with tarfile.open(tmp_path / "00003.tar") as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == [f"00003{n:04d}.{s}" for n in (0, 2, 4) for s in ("jpg", "txt", "json")]
        assert all(m.isfile() and m.mode == 0o444 for m in members)
        assert tar.extractfile("000030002.jpg").read() == bytes([2]) * 702  # type: ignore[union-attr]
        assert tar.extractfile("000030000.txt").read().decode() == "é caption 0"  # type: ignore[union-attr]
        meta = json.loads(tar.extractfile("000030000.json").read())  # type: ignore[union-attr]
        assert meta["license"] == "cc0" and meta["exif"] == '{"0x10f": "x"}' and meta["x_robots_tag"] == ["noai"]
    table = pq.read_table(tmp_path / "00003.parquet")
    assert table.schema.names == ["key", "url", "caption", "license", "score", "status", "error_message",
                                  "http_status", "width", "height", "compression_quality", "filesize", "exif",
                                  "x_robots_tag"]
    assert table.schema.field("score").type == pa.float64()  # additional columns keep their type
    assert table.num_rows == 5 and table.column("http_status").to_pylist() == [None, 403, None, 403, None]
    assert json.loads((tmp_path / "00003_stats.json").read_text()) == {"count": 5}


@pytest.mark.skipif(shutil.which("tar") is None, reason="no tar program on this machine")
def test_gnu_tar_reads_the_archive(tmp_path: Path) -> None:
    write(tmp_path, "webdataset")
    listing = subprocess.run(["tar", "-tvf", str(tmp_path / "00003.tar")], capture_output=True, text=True, check=True)
    assert listing.stdout.count("\n") == 9 and "000030004.json" in listing.stdout and not listing.stderr


def test_parquet(tmp_path: Path) -> None:
    write(tmp_path, "parquet")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00003.parquet", "00003_stats.json"]
    table = pq.read_table(tmp_path / "00003.parquet")
    assert table.schema.field("jpg").type == pa.binary()
    assert table.column("jpg").to_pylist() == [image for _, image in rows()]


def test_files(tmp_path: Path) -> None:
    write(tmp_path, "files")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00003", "00003.parquet", "00003_stats.json"]
    assert sorted(p.name for p in (tmp_path / "00003").iterdir()) == sorted(
        f"00003{n:04d}.{s}" for n in (0, 2, 4) for s in ("jpg", "txt", "json"))
    assert (tmp_path / "00003" / "000030004.jpg").read_bytes() == bytes([4]) * 704


@pytest.mark.parametrize("fmt", ["webdataset", "parquet", "files"])
def test_leftovers_of_an_unpublished_shard_are_discarded(tmp_path: Path, fmt: str) -> None:
    writer = shard_writer(fmt, tmp_path, 3, row_schema(INPUT))
    for row, image in rows():
        writer.add(row, image)
    discard_leftovers(tmp_path, 3)
    assert list(tmp_path.iterdir()) == []


def test_a_publication_cut_short_is_discarded_whole(tmp_path: Path) -> None:
    write(tmp_path, "files")
    (tmp_path / "00003_stats.json").unlink()  # a crash before the stats file, the last rename
    discard_leftovers(tmp_path, 3)
    assert list(tmp_path.iterdir()) == []
    write(tmp_path, "webdataset")
    with pytest.raises(ValueError):
        discard_leftovers(tmp_path, 3)  # a complete shard is never discarded


def test_a_lists_columns_named_like_ours_are_kept_under_another_name() -> None:
    schema = INPUT.append(pa.field("width", pa.string())).append(pa.field("width_input", pa.int8())) \
        .append(pa.field("jpg", pa.string()))
    assert extra_columns(schema) == {"license": "license", "score": "score", "width": "width_input_input",
                                     "width_input": "width_input", "jpg": "jpg_input"}
    names = row_schema(schema).names
    assert len(names) == len(set(names))


def test_a_long_member_name_is_refused() -> None:
    with pytest.raises(ValueError):
        TarMembers(io.BytesIO(), 0).add("x" * 100, b"")


@pytest.mark.parametrize("size", [0, 1, 511, 512, 513, 100_000])
def test_any_member_size_reads_back(size: int) -> None:
    out = io.BytesIO()
    members = TarMembers(out, 1_700_000_000)
    members.add("a.jpg", b"x" * size)
    members.add("a.txt", b"")
    members.close()
    assert len(out.getvalue()) % 512 == 0
    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tar:
        assert [(m.name, m.size, m.mtime) for m in tar.getmembers()] == [("a.jpg", size, 1_700_000_000),
                                                                         ("a.txt", 0, 1_700_000_000)]
