"""URL lists in img2dataset's formats, read as a stream of row batches.

``txt`` (one URL a line), ``csv`` and ``tsv`` (a header row), ``jsonl`` (an
object a line), ``json`` (an array of objects) and ``parquet``. Each reader
yields batches of at most ``BATCH_ROWS`` rows, so memory holds one batch
whatever the list's length; Parquet is read a record batch at a time, and
only the columns asked for (a row group at a time). Rows are numbered from 1 within their file,
the header not counted (in txt and jsonl that is the line number): that is
the number a bad row is reported by. A row that cannot be read at all (a
line of broken JSON) is a batch entry with a reason instead of values; a
file that cannot be read at all raises ``BadFile``.
"""
from __future__ import annotations

import csv
import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pyarrow.parquet as pq

FORMATS = ("txt", "csv", "tsv", "json", "jsonl", "parquet")
BATCH_ROWS = 10_000
JSON_CHUNK = 1 << 20  # characters a JSON array is read by


class BadFile(Exception):
    """A file (or a path pattern) that cannot be read as a URL list at all."""


@dataclass
class Columns:
    """Which columns hold what; ``id`` and ``source`` are optional."""

    url: str = "url"
    id: str | None = None
    source: str | None = None
    extra: tuple[str, ...] = ()  # more columns, read as they are, after (url, id, source)

    def names(self) -> list[str]:
        return [name for name in (self.url, self.id, self.source, *self.extra) if name is not None]

    def slots(self) -> tuple[str | None, ...]:
        """The column of each value of a row, in order: url, id, source, then the extra ones."""
        return (self.url, self.id, self.source, *self.extra)


@dataclass
class Batch:
    """Consecutive rows of one file: ``first_row`` is the number of ``values[0]``.

    ``values[i]`` is (url, id, source, *extra) with None where the column is not read or the
    row lacks it, or None for a blank line or a row that could not be read at all;
    ``errors`` maps the index of the latter to the reason.
    """

    path: str
    first_row: int
    values: list[tuple[Any, ...] | None] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    rows: int = 0  # len(values), kept once the values are handed over

    def __post_init__(self) -> None:
        self.rows = self.rows or len(self.values)


def expand(patterns: list[str], input_format: str | None) -> list[Path]:
    """Paths, globs and folders to the files they name, in a stable order (sorted per argument).

    A folder stands for its files of ``input_format`` (img2dataset reads a folder so).
    """
    files: list[Path] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matched = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matched:
                raise BadFile(f"{pattern}: no file matches")
            files += matched
        elif os.path.isdir(pattern):
            if input_format is None:
                raise BadFile(f"{pattern}: a folder needs --input-format, to know which files to read")
            matched = sorted(p for p in Path(pattern).iterdir() if p.is_file() and p.suffix == f".{input_format}")
            if not matched:
                raise BadFile(f"{pattern}: no .{input_format} file in the folder")
            files += matched
        elif os.path.isfile(pattern):
            files.append(Path(pattern))
        else:
            raise BadFile(f"{pattern}: no such file")
    return files


def format_of(path: Path, input_format: str | None) -> str:
    if input_format is not None:
        return input_format
    suffix = path.suffix.lstrip(".").lower()
    if suffix in FORMATS:
        return suffix
    raise BadFile(f"{path}: cannot tell its format from the name; give --input-format ({', '.join(FORMATS)})")


def read_batches(path: Path, input_format: str, columns: Columns, skip_rows: int = 0) -> Iterator[Batch]:
    """The rows of one file, in batches; the first ``skip_rows`` rows are passed over (resuming)."""
    try:
        if input_format == "parquet":
            yield from _parquet(path, columns, skip_rows)
            return
        with path.open(encoding="utf-8", errors="surrogateescape", newline="") as text:
            if input_format == "txt":
                rows = _txt(text, columns)
            elif input_format in ("csv", "tsv"):
                rows = _delimited(text, "\t" if input_format == "tsv" else ",", columns, str(path))
            elif input_format == "jsonl":
                rows = _jsonl(text, columns)
            elif input_format == "json":
                rows = _json_array(text, columns, str(path))
            else:
                raise BadFile(f"{path}: unknown input format {input_format!r}")
            yield from _batched(str(path), rows, skip_rows)
    except OSError as exc:
        raise BadFile(f"{path}: {exc.strerror or exc}") from None


Row = tuple[int, tuple[Any, ...] | None, str]  # number, values or None, why not


def _batched(path: str, rows: Iterator[Row], skip_rows: int) -> Iterator[Batch]:
    batch: Batch | None = None
    for number, values, error in rows:
        if number <= skip_rows:
            continue
        if batch is None:
            batch = Batch(path, number)
        index = number - batch.first_row
        while len(batch.values) < index:  # blank lines keep their numbers: nothing there
            batch.values.append(None)
        if values is None:
            batch.errors[index] = error
        batch.values.append(values)
        if len(batch.values) >= BATCH_ROWS:
            batch.rows = len(batch.values)
            yield batch
            batch = None
    if batch is not None:
        batch.rows = len(batch.values)
        yield batch


def _pick(record: Any, columns: Columns) -> tuple[tuple[Any, ...] | None, str]:
    if not isinstance(record, dict):
        return None, f"expected a JSON object, got {type(record).__name__}"
    return tuple(record.get(name) if name else None for name in columns.slots()), ""


def _txt(text: IO[str], columns: Columns) -> Iterator[Row]:
    nothing = (None,) * (len(columns.slots()) - 1)  # a line is a URL and nothing else
    for number, line in enumerate(text, 1):
        url = line.strip()
        if url:
            yield number, (url, *nothing), ""


def _jsonl(text: IO[str], columns: Columns) -> Iterator[Row]:
    for number, line in enumerate(text, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:
            yield number, None, f"not JSON: {str(exc)[:200]}"
            continue
        values, error = _pick(record, columns)
        yield number, values, error


def _delimited(text: IO[str], delimiter: str, columns: Columns, path: str) -> Iterator[Row]:
    # A TSV's quotes are data (as the TSV producer reads it); a CSV's are quoting.
    if delimiter == "\t":
        reader = csv.reader(text, delimiter=delimiter, quoting=csv.QUOTE_NONE)
    else:
        reader = csv.reader(text, delimiter=delimiter, quoting=csv.QUOTE_MINIMAL)
    try:
        header = next(reader)
    except StopIteration:
        return
    except csv.Error as exc:
        raise BadFile(f"{path}: the header row cannot be read: {exc}") from None
    missing = [name for name in columns.names() if name not in header]
    if missing:
        raise BadFile(f"{path}: the header row lacks {', '.join(missing)} (it has {', '.join(header)[:300]})")
    at = [header.index(name) if name else None for name in columns.slots()]
    number = 0
    while True:
        number += 1
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            yield number, None, f"cannot be read: {exc}"
            continue
        yield number, tuple(fields[i] if i is not None and i < len(fields) else None for i in at), ""


def _json_array(text: IO[str], columns: Columns, path: str) -> Iterator[Row]:
    """A JSON array of objects, decoded one element at a time (never the whole file at once)."""
    decoder = json.JSONDecoder()
    buffer, at, ended = "", 0, False

    def fill() -> bool:
        nonlocal buffer, at, ended
        chunk = text.read(JSON_CHUNK)
        buffer, at, ended = buffer[at:] + chunk, 0, not chunk
        return bool(chunk)

    def skip_space() -> None:
        nonlocal at
        while True:
            while at < len(buffer) and buffer[at].isspace():
                at += 1
            if at < len(buffer) or not fill():
                return

    skip_space()
    if at >= len(buffer) or buffer[at] != "[":
        raise BadFile(f"{path}: a json list must be an array of objects ([{{...}}, ...]); use jsonl for one a line")
    at += 1
    number = 0
    while True:
        skip_space()
        if at < len(buffer) and buffer[at] == "]":
            return
        if number and at < len(buffer) and buffer[at] == ",":
            at += 1
            skip_space()
        while True:
            try:
                record, end = decoder.raw_decode(buffer, at)
                break
            except (ValueError, RecursionError) as exc:
                if not ended and fill():
                    continue  # the element may run past the buffer: read more and try again
                raise BadFile(f"{path}: broken JSON after row {number}: {str(exc)[:200]}") from None
        if end == len(buffer) and not ended:  # a number may go on past the buffer: decode it whole
            if fill():
                continue
        at = end
        number += 1
        values, error = _pick(record, columns)
        yield number, values, error


def _parquet(path: Path, columns: Columns, skip_rows: int) -> Iterator[Batch]:
    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds for a file that is not Parquet
        raise BadFile(f"{path}: not a Parquet file: {exc}") from None
    names = parquet.schema_arrow.names
    missing = [name for name in columns.names() if name not in names]
    if missing:
        raise BadFile(f"{path}: the file has no column {', '.join(missing)} (it has {', '.join(names)[:300]})")
    wanted = list(dict.fromkeys(columns.names()))
    first = 1
    # A row group at a time, then sliced: ``iter_batches`` kept ~12 bytes a row of Arrow
    # memory alive (34 MiB after 3,000,000 rows), reading row groups stays flat.
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if first + rows - 1 <= skip_rows:  # resuming: the whole row group was produced already
            first += rows
            continue
        table = parquet.read_row_group(group, columns=wanted)
        for start in range(max(0, skip_rows - first + 1), rows, BATCH_ROWS):
            count = min(BATCH_ROWS, rows - start)
            lists = [table.column(name).slice(start, count).to_pylist() if name else [None] * count
                     for name in columns.slots()]
            values: list[tuple[Any, ...] | None] = list(zip(*lists, strict=True))
            yield Batch(str(path), first + start, values)
        first += rows
        del table
