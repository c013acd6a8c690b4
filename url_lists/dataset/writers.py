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

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, BinaryIO, Protocol

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
    pa.field("width", pa.int32()),              # the downloaded image's own size, not the thumbnail's
    pa.field("height", pa.int32()),
    pa.field("compression_quality", pa.int32()),  # JPEG quality 1-100; null for other formats
    pa.field("filesize", pa.int64()),           # bytes downloaded
    pa.field("exif", pa.string()),              # JSON object of tag number (hex) -> value
    pa.field("x_robots_tag", pa.list_(pa.string())),
]
BUFFER_ROWS = 256
BUFFER_BYTES = 8 << 20  # a parquet shard's buffered image bytes before a row group is written


_OWN_COLUMNS = frozenset(["key", "url", "caption", IMAGE_COLUMN] + [f.name for f in OUTCOME_FIELDS])


def extra_columns(input_schema: pa.Schema) -> dict[str, str]:
    """The input's additional columns and their names in the output: a list's own ``status`` or
    ``width`` column is kept as ``status_input``, ``width_input`` (never lost, never mistaken)."""
    names: dict[str, str] = {}
    for name in additional_columns(input_schema):
        out = name
        while out in _OWN_COLUMNS or out in names.values() or (out != name and out in input_schema.names):
            out += "_input"
        names[name] = out
    return names


def row_schema(input_schema: pa.Schema) -> pa.Schema:
    """A shard's rows: key, url, caption, the input's additional columns as they were read, the outcome."""
    fields = [pa.field("key", pa.string()), pa.field("url", pa.string()), pa.field("caption", pa.string())]
    fields += [input_schema.field(name).with_name(out) for name, out in extra_columns(input_schema).items()]
    return pa.schema(fields + OUTCOME_FIELDS)


def shard_name(shard: int) -> str:
    return f"{shard:05d}"


class ShardWriter(Protocol):
    unsynced: int  # image bytes added since the last sync_data

    def add(self, row: dict[str, Any], image: bytes | None) -> None: ...
    def sync_data(self) -> None:
        """Flush what is written so far to the disk (off the event loop), so that publishing
        a large shard does not wait for all of it at once."""
    def publish(self, stats: dict[str, Any]) -> None: ...
    def discard(self) -> None: ...


class _Rows:
    """Rows buffered and written to a Parquet file in row groups; optionally an image column."""

    def __init__(self, path: Path, schema: pa.Schema):
        self.path = path
        self.schema = schema
        # Images are unique: a dictionary of them is a hash of every image, then thrown away.
        self._writer = pq.ParquetWriter(path, schema, use_dictionary=[
            name for name in schema.names if name != IMAGE_COLUMN])
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
    return json.dumps(row, ensure_ascii=False).encode()


def _write_stats(folder: Path, shard: int, stats: dict[str, Any]) -> None:
    final = folder / f"{shard_name(shard)}_stats.json"
    temporary = temporary_name(final)
    with temporary.open("w") as out:
        json.dump(stats, out, indent=4)
        out.flush()
        os.fsync(out.fileno())
    publish(temporary, final)


class TarMembers:
    """Regular files appended to a POSIX ustar archive, each written in one call (header, data,
    padding). tarfile.addfile built a header through copies and generic field encoders: about
    a tenth of the collector's CPU an image. Names are keys and suffixes (ASCII, under 100
    bytes); the archive is read by tarfile, webdataset and GNU tar alike (a test reads it back)."""

    def __init__(self, out: BinaryIO, mtime: int):
        head = bytearray(BLOCK)
        head[100:108] = b"0000444\0"        # mode
        head[108:116] = b"0000000\0"        # uid
        head[116:124] = b"0000000\0"        # gid
        head[136:148] = b"%011o\0" % mtime   # mtime
        head[148:156] = b" " * 8            # the checksum counts its own field as spaces
        head[156:157] = b"0"                # a regular file
        head[257:265] = b"ustar\x0000"      # POSIX ustar, version 00
        self._head = head
        self._head_sum = sum(head)
        self._out = out

    def add(self, name: str, data: bytes) -> None:
        encoded = name.encode("ascii")
        if len(encoded) > 99:
            raise ValueError(f"a member name longer than 99 bytes: {name[:120]!r}")
        head = bytearray(self._head)
        head[0:len(encoded)] = encoded
        size = b"%011o\0" % len(data)
        head[124:136] = size
        checksum = self._head_sum + sum(encoded) + sum(size)
        head[148:156] = b"%06o\0 " % checksum
        self._out.write(b"".join((head, data, bytes(-len(data) % BLOCK))))

    def close(self) -> None:
        self._out.write(bytes(2 * BLOCK))  # the end of the archive: two zero blocks


BLOCK = 512


class WebDatasetWriter:
    def __init__(self, folder: Path, shard: int, schema: pa.Schema):
        self._folder, self._shard = folder, shard
        self._tar_path = folder / f"{shard_name(shard)}.tar"
        self._rows_path = folder / f"{shard_name(shard)}.parquet"
        self._file = temporary_name(self._tar_path).open("wb")
        self._tar = TarMembers(self._file, int(time.time()))
        self._rows = _Rows(temporary_name(self._rows_path), schema)
        self.unsynced = 0

    def sync_data(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def add(self, row: dict[str, Any], image: bytes | None) -> None:
        if image is not None:
            key = row["key"]
            self.unsynced += len(image)
            self._tar.add(f"{key}.jpg", image)
            self._tar.add(f"{key}.txt", (row.get("caption") or "").encode())
            self._tar.add(f"{key}.json", _sample_json(row))
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
        self.unsynced = 0

    def sync_data(self) -> None:
        fsync_path(self._rows.path)  # the row groups written so far

    def add(self, row: dict[str, Any], image: bytes | None) -> None:
        self.unsynced += len(image) if image else 0
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
        self.unsynced = 0

    def sync_data(self) -> None:
        written, self._written = self._written, []
        for path in written:
            fsync_path(path)

    def add(self, row: dict[str, Any], image: bytes | None) -> None:
        if image is not None:
            key = row["key"]
            self.unsynced += len(image)
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
    """Whatever a crash left of a shard with no stats file (so incomplete): its temporary
    outputs, and the files a publication cut short had already renamed into place."""
    name = shard_name(shard)
    if stats_path(folder, shard).exists():
        raise ValueError(f"shard {shard} is complete: its outputs are not leftovers")
    for final in (folder / f"{name}.tar", folder / f"{name}.parquet", folder / f"{name}_stats.json"):
        temporary_name(final).unlink(missing_ok=True)
        final.unlink(missing_ok=True)
    for directory in (folder / name, temporary_name(folder / name)):
        shutil.rmtree(directory, ignore_errors=True)
