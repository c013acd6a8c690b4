"""A shard's outputs in img2dataset's layout, written as samples come and published whole.

- ``webdataset``: ``{shard}.tar`` with ``{key}.jpg``, ``{key}.txt`` (the caption) and
  ``{key}.json`` (the row) per success;
- ``parquet``: the rows with the image bytes in a ``jpg`` column;
- ``files``: a folder ``{shard}/`` with the same three files per success;

and, for webdataset and files, ``{shard}.parquet`` with one row per input row; for all,
``{shard}_stats.json``. Everything is written under a temporary name (a leading dot) and
renamed once the shard is complete, the stats file last: a shard with its stats file is
complete, and one without is rebuilt from its journal (``journal.py``). Images are written
as the crawler stored them (already within the image size): no decoding, no re-encoding.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import time
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from url_lists.dataset.files import fsync_path, publish, temporary_name
from url_lists.dataset.inputs import additional_columns

FORMATS = ("webdataset", "parquet", "files")
IMAGE_COLUMN = "jpg"
# The columns after the input's (key, url, caption, its additional columns).
OUTCOME_FIELDS = [
    pa.field("status", pa.string()),            # success, link_rot, error (img2dataset's name; "success" alike)
    pa.field("error_message", pa.string()),     # an error's reason (img2dataset's name)
    pa.field("http_status", pa.int32()),
    pa.field("width", pa.int32()),              # the image's real size, as measured by the crawler
    pa.field("height", pa.int32()),
    pa.field("compression_quality", pa.int32()),  # JPEG quality 1-100; null for other formats
    pa.field("filesize", pa.int64()),           # bytes downloaded
    pa.field("exif", pa.string()),              # JSON object of tag number (hex) -> value
    pa.field("x_robots_tag", pa.list_(pa.string())),
]
BUFFER_ROWS = 256
BUFFER_BYTES = 8 << 20  # a parquet shard's buffered image bytes before a row group is written


def row_schema(input_schema: pa.Schema) -> pa.Schema:
    """A shard's rows: key, url, caption, the input's additional columns as they were read, the outcome."""
    fields = [pa.field("key", pa.string()), pa.field("url", pa.string()), pa.field("caption", pa.string())]
    fields += [input_schema.field(name) for name in additional_columns(input_schema)]
    return pa.schema(fields + OUTCOME_FIELDS)


def shard_name(shard: int) -> str:
    return f"{shard:05d}"


class ShardWriter(Protocol):
    def add(self, row: dict[str, Any], image: bytes | None) -> None: ...
    def publish(self, stats: dict[str, Any]) -> None: ...
    def discard(self) -> None: ...


class _Rows:
    """Rows buffered and written to a Parquet file in row groups; optionally an image column."""

    def __init__(self, path: Path, schema: pa.Schema):
        self.path = path
        self.schema = schema
        self._writer = pq.ParquetWriter(path, schema)
        self._buffer: list[dict[str, Any]] = []
        self._bytes = 0

    def add(self, row: dict[str, Any], size: int = 0) -> None:
        self._buffer.append(row)
        self._bytes += size
        if len(self._buffer) >= BUFFER_ROWS or self._bytes >= BUFFER_BYTES:
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            self._writer.write_table(pa.Table.from_pylist(self._buffer, schema=self.schema))
            self._buffer, self._bytes = [], 0

    def close(self) -> None:
        self.flush()
        self._writer.close()
        fsync_path(self.path)


def _sample_json(row: dict[str, Any]) -> bytes:
    return json.dumps(row, ensure_ascii=False, default=str).encode()


def _write_stats(folder: Path, shard: int, stats: dict[str, Any]) -> None:
    final = folder / f"{shard_name(shard)}_stats.json"
    temporary = temporary_name(final)
    with temporary.open("w") as out:
        json.dump(stats, out, indent=4)
        out.flush()
        os.fsync(out.fileno())
    publish(temporary, final)


class WebDatasetWriter:
    def __init__(self, folder: Path, shard: int, schema: pa.Schema):
        self._folder, self._shard = folder, shard
        self._tar_path = folder / f"{shard_name(shard)}.tar"
        self._rows_path = folder / f"{shard_name(shard)}.parquet"
        self._file = temporary_name(self._tar_path).open("wb")
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.USTAR_FORMAT)
        self._rows = _Rows(temporary_name(self._rows_path), schema)
        self._now = int(time.time())

    def _member(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), self._now, 0o444
        self._tar.addfile(info, io.BytesIO(data))

    def add(self, row: dict[str, Any], image: bytes | None) -> None:
        if image is not None:
            key = row["key"]
            self._member(f"{key}.jpg", image)
            self._member(f"{key}.txt", (row.get("caption") or "").encode())
            self._member(f"{key}.json", _sample_json(row))
        self._rows.add(row)

    def publish(self, stats: dict[str, Any]) -> None:
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._rows.close()
        publish(temporary_name(self._tar_path), self._tar_path)
        publish(self._rows.path, self._rows_path)
        _write_stats(self._folder, self._shard, stats)

    def discard(self) -> None:
        self._file.close()
        for path in (temporary_name(self._tar_path), self._rows.path):
            path.unlink(missing_ok=True)


class ParquetWriter:
    """The rows and their images in one file: img2dataset's ``parquet`` output."""

    def __init__(self, folder: Path, shard: int, schema: pa.Schema):
        self._folder, self._shard = folder, shard
        self._path = folder / f"{shard_name(shard)}.parquet"
        self._rows = _Rows(temporary_name(self._path), schema.append(pa.field(IMAGE_COLUMN, pa.binary())))

    def add(self, row: dict[str, Any], image: bytes | None) -> None:
        self._rows.add({**row, IMAGE_COLUMN: image}, len(image) if image else 0)

    def publish(self, stats: dict[str, Any]) -> None:
        self._rows.close()
        publish(self._rows.path, self._path)
        _write_stats(self._folder, self._shard, stats)

    def discard(self) -> None:
        self._rows.path.unlink(missing_ok=True)


class FilesWriter:
    """A folder per shard with ``{key}.jpg``, ``.txt`` and ``.json``: img2dataset's ``files`` output."""

    def __init__(self, folder: Path, shard: int, schema: pa.Schema):
        self._folder, self._shard = folder, shard
        self._dir = folder / shard_name(shard)
        self._temporary_dir = temporary_name(self._dir)
        shutil.rmtree(self._temporary_dir, ignore_errors=True)
        self._temporary_dir.mkdir(parents=True)
        self._rows_path = folder / f"{shard_name(shard)}.parquet"
        self._rows = _Rows(temporary_name(self._rows_path), schema)
        self._written: list[Path] = []

    def add(self, row: dict[str, Any], image: bytes | None) -> None:
        if image is not None:
            key = row["key"]
            for suffix, data in (("jpg", image), ("txt", (row.get("caption") or "").encode()),
                                 ("json", _sample_json(row))):
                path = self._temporary_dir / f"{key}.{suffix}"
                path.write_bytes(data)
                self._written.append(path)
        self._rows.add(row)

    def publish(self, stats: dict[str, Any]) -> None:
        for path in self._written:
            fsync_path(path)
        fsync_path(self._temporary_dir)
        self._rows.close()
        shutil.rmtree(self._dir, ignore_errors=True)  # a previous publication cut short
        publish(self._temporary_dir, self._dir)
        publish(self._rows.path, self._rows_path)
        _write_stats(self._folder, self._shard, stats)

    def discard(self) -> None:
        shutil.rmtree(self._temporary_dir, ignore_errors=True)
        self._rows.path.unlink(missing_ok=True)


WRITERS: dict[str, type[WebDatasetWriter] | type[ParquetWriter] | type[FilesWriter]] = {
    "webdataset": WebDatasetWriter, "parquet": ParquetWriter, "files": FilesWriter}


def shard_writer(output_format: str, folder: Path, shard: int, schema: pa.Schema) -> ShardWriter:
    if output_format not in WRITERS:
        raise ValueError(f"unknown output format {output_format!r}; one of {', '.join(FORMATS)}")
    return WRITERS[output_format](folder, shard, schema)


def stats_path(folder: Path, shard: int) -> Path:
    return folder / f"{shard_name(shard)}_stats.json"


def discard_leftovers(folder: Path, shard: int) -> None:
    """Whatever a crash left of an unfinished shard's temporary outputs."""
    name = shard_name(shard)
    for final in (folder / f"{name}.tar", folder / f"{name}.parquet", folder / f"{name}_stats.json"):
        temporary_name(final).unlink(missing_ok=True)
    shutil.rmtree(temporary_name(folder / name), ignore_errors=True)
