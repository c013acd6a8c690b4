"""What is checked before anything starts: the list's files and columns, the output folder,
the servers' settings and the run the folder already holds. Each failure is an
``OptionError`` whose message is the one line the user sees."""
from __future__ import annotations

import csv
import json
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from url_lists.crawl.options import CrawlOptions, OptionError
from url_lists.progress import save_json_atomically
from url_lists.readers import BadFile, Columns, expand, format_of, read_batches

CRAWL_DIR = "_crawl"   # the crawl's own state under the output folder
RUN_FILE = "run.json"
# A fleet's addresses: all set, the command starts nothing and only produces and collects.
FLEET_SETTINGS = ("KAFKA_HOSTS", "REDIS_URL")
S3_SETTINGS = ("S3_ENDPOINT_URL", "S3_BUCKET")


@dataclass
class Listing:
    """The list as read: its files, each one's format, and the columns wanted."""

    files: list[Path]
    formats: list[str]
    url_col: str
    caption_col: str | None = None
    additional: tuple[str, ...] = ()

    def columns(self) -> Columns:
        extra = ((self.caption_col,) if self.caption_col else ()) + self.additional
        return Columns(url=self.url_col, extra=extra)


def listing(options: CrawlOptions) -> Listing:
    """The files to read and their formats, each file checked for the columns asked for."""
    try:
        files = expand(list(options.url_list), options.input_format)
        formats = [format_of(path, options.input_format) for path in files]
    except BadFile as exc:
        raise OptionError(str(exc)) from None
    wanted = [name for name in (options.url_col, options.caption_col, *options.save_additional_columns) if name]
    for path, kind in zip(files, formats, strict=True):
        if kind == "txt":
            if options.caption_col or options.save_additional_columns:
                raise OptionError(f"{path}: a txt list has only URLs: --caption_col and "
                                  "--save_additional_columns need another --input_format")
            continue
        missing = [name for name in wanted if name not in _columns_of(path, kind, options.url_col)]
        if missing:
            raise OptionError(f"{path}: no column {', '.join(missing)}")
    return Listing(files, formats, options.url_col, options.caption_col, options.save_additional_columns)


def _columns_of(path: Path, kind: str, url_col: str) -> set[str]:
    """The column names a file has: Parquet's schema, the header row, or the first record's keys."""
    try:
        if kind == "parquet":
            try:
                return set(pq.ParquetFile(path).schema_arrow.names)
            except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds for a file that is not Parquet
                raise OptionError(f"{path}: not a Parquet file ({str(exc)[:200]})") from None
        if kind in ("csv", "tsv"):
            with path.open(encoding="utf-8", errors="surrogateescape", newline="") as text:
                if kind == "tsv":
                    reader = csv.reader(text, delimiter="\t", quoting=csv.QUOTE_NONE)
                else:
                    reader = csv.reader(text)
                return set(next(reader, []))
        # json, jsonl: the keys of the first record (one that lacks the url is a bad row, not a bad file)
        for batch in read_batches(path, kind, Columns(url=url_col)):
            for values in batch.values:
                if values is not None:
                    return {url_col} if values[0] is not None else set()
            return set()
        return set()
    except (OSError, csv.Error) as exc:
        raise OptionError(f"{path}: cannot be read ({exc})") from None
    except BadFile as exc:
        raise OptionError(str(exc)) from None


def writable_folder(folder: Path) -> None:
    """Create it if need be and write a file there, or say why not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise OptionError(f"--output_folder {folder}: cannot write there ({exc.strerror or exc})") from None


def fleet(env: Mapping[str, str]) -> bool:
    """True with a fleet's settings (start nothing), False with none (embedded); half of them is refused."""
    given = [name for name in (*FLEET_SETTINGS, *S3_SETTINGS) if env.get(name, "").strip()]
    if not given:
        return False
    missing = [name for name in FLEET_SETTINGS if name not in given]
    if not any(name in given for name in S3_SETTINGS):
        missing.append("S3_BUCKET")
    if missing:
        raise OptionError(f"{', '.join(given)} set but not {', '.join(missing)}: set them all to crawl with a "
                          "fleet, or none to crawl on this machine")
    return True


@dataclass(frozen=True)
class Run:
    run: uuid.UUID
    resumed: bool


def run_file(folder: Path) -> Path:
    return folder / CRAWL_DIR / RUN_FILE


def saved_options(options: CrawlOptions, files: list[Path]) -> dict[str, Any]:
    """What a resumed run must share with its first: the options and the list, file by file
    (path, size, modification time), as its rows are numbered from them."""
    described = [[str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns] for path in files]
    return {**options.dataset_options(), "files": described}


def existing_run(options: CrawlOptions, files: list[Path]) -> uuid.UUID | None:
    """The run the folder holds, if the command resumes it; refuses a folder it must not write into."""
    folder = options.output_folder
    path = run_file(folder)
    if path.exists():
        if options.incremental_mode == "overwrite":
            return None
        try:
            saved = json.loads(path.read_text())
            run = uuid.UUID(saved["run"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise OptionError(f"{path}: unreadable ({exc}); --incremental_mode overwrite starts over") from None
        now = saved_options(options, files)
        differ = [name for name, value in now.items() if saved.get("options", {}).get(name) != value]
        if differ:
            raise OptionError(f"--output_folder {folder} holds a crawl made with other options ({', '.join(differ)}): "
                              "the same command resumes it, --incremental_mode overwrite starts over")
        return run
    others = [p.name for p in folder.iterdir() if p.name != CRAWL_DIR] if folder.is_dir() else []
    if others:
        named = ", ".join(sorted(others)[:3]) + ("..." if len(others) > 3 else "")
        raise OptionError(f"--output_folder {folder} holds files that are not a crawl's ({named}): "
                          "choose a new or empty folder")
    return None


def start_run(options: CrawlOptions, files: list[Path], keys_new_run: Any) -> Run:
    """Resume the folder's run, or clear the folder (overwrite) and record a new one."""
    folder = options.output_folder
    run = existing_run(options, files)
    if run is not None:
        return Run(run, True)
    if options.incremental_mode == "overwrite" or (folder / CRAWL_DIR).exists():
        for entry in folder.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    run = keys_new_run()
    (folder / CRAWL_DIR).mkdir(parents=True, exist_ok=True)
    save_json_atomically(run_file(folder), {"run": str(run), "options": saved_options(options, files)})
    return Run(run, False)
