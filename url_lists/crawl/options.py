"""``python -m url_lists crawl``'s command line: img2dataset's option names, checked before anything starts.

An img2dataset command line works with the program name changed: its options are
read under their own names (``--url_list``, ``--url-list`` and ``--url_list=...``
alike, a bare boolean flag meaning True, as python-fire reads them). Each of
img2dataset's options is in exactly one of three tables: used here, accepted with one
warning line (it tunes img2dataset's own machinery and means nothing here), or
accepted only at the value this crawler's results have (anything else is refused with
one line naming it). Any other option is refused too.
"""
from __future__ import annotations

import argparse
import ast
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from url_lists.readers import FORMATS

OUTPUT_FORMATS = ("webdataset", "parquet", "files")
INCREMENTAL_MODES = ("incremental", "overwrite")
IMAGE_SIZE_RANGE = (16, 10_000)  # TARGET_RESOLUTION's range (common.settings)
THUMBNAIL_QUALITY = 85           # worker.constants.THUMBNAIL_JPEG_QUALITY, the quality of every stored image

# img2dataset's options that tune its own downloader or distributor: accepted, one warning each.
IGNORED = {
    "thread_count": "the workers size their concurrency per site",
    "distributor": "workers on this machine, or a fleet reading Kafka",
    "subjob_size": "rows are produced to Kafka as they are read",
    "timeout": "the workers' timeouts apply",
    "retries": "a failed fetch is retried by the crawler's own policy (MAX_RETRIES)",
    "enable_wandb": "the monitor's dashboard and /metrics report the crawl",
    "wandb_project": "the monitor's dashboard and /metrics report the crawl",
    "oom_shard_count": "shards are numbered from the row number",
    "max_shard_retry": "a row without an outcome is crawled again by the next run",
    "compute_hash": "no hash column is written",
    "extract_exif": "EXIF is always measured",
    "disallowed_header_directives": "X-Robots-Tag is always honoured",
    "upscale_interpolation": "images are never upscaled",
    "downscale_interpolation": "images are downscaled with the workers' own filter",
}


def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in ("true", "1", "yes"))


def _falsy(value: Any) -> bool:
    return value is False or (isinstance(value, str) and value.strip().lower() in ("false", "0", "no"))


def _number_is(expected: float) -> Any:
    def check(value: Any) -> bool:
        try:
            return float(value) == expected
        except (TypeError, ValueError):
            return False
    return check


# img2dataset's options accepted only where their value is what this crawler does: name ->
# (whether a value is ours, what we do).
ONLY_AS_WE_DO = {
    "resize_mode": (lambda v: str(v) == "keep_ratio_largest",
                    "stored images keep their ratio, the longer side at most --image_size (keep_ratio_largest)"),
    "resize_only_if_bigger": (_truthy, "images are never upscaled (--resize_only_if_bigger True)"),
    "encode_format": (lambda v: str(v) in ("jpg", "jpeg"), "stored images are JPEG (--encode_format jpg)"),
    "encode_quality": (_number_is(THUMBNAIL_QUALITY), f"stored images are JPEG quality {THUMBNAIL_QUALITY}"),
    "skip_reencode": (_falsy, "every stored image is re-encoded"),
    "disable_all_reencoding": (_falsy, "every stored image is re-encoded"),
    "min_image_size": (_number_is(0), "no image is filtered by its size"),
    "max_image_area": (_number_is(math.inf), "no image is filtered by its area"),
    "max_aspect_ratio": (_number_is(math.inf), "no image is filtered by its aspect ratio"),
    "bbox_col": (lambda v: False, "no bounding-box blurring"),
    "verify_hash": (lambda v: False, "no hash is verified"),
}


class OptionError(ValueError):
    """A command line that cannot run; the message is the one line the user sees."""


@dataclass(frozen=True)
class CrawlOptions:
    url_list: tuple[str, ...]
    output_folder: Path
    input_format: str | None = None        # None: each file's extension says
    url_col: str = "url"
    caption_col: str | None = None
    save_additional_columns: tuple[str, ...] = ()
    output_format: str = "files"
    number_sample_per_shard: int = 10_000
    image_size: int = 256
    processes_count: int = 1
    user_agent_token: str | None = None
    incremental_mode: str = "incremental"
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def dataset_options(self) -> dict[str, Any]:
        """What a resumed run must share with the run it resumes (kept in run.json)."""
        return {"output_format": self.output_format, "number_sample_per_shard": self.number_sample_per_shard,
                "image_size": self.image_size, "url_col": self.url_col, "caption_col": self.caption_col,
                "save_additional_columns": list(self.save_additional_columns),
                "input_format": self.input_format}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise OptionError(message)


def _spellings(name: str) -> list[str]:
    names = [f"--{name}"]
    if "_" in name:
        names.append(f"--{name.replace('_', '-')}")
    return names


def _parser() -> _Parser:
    parser = _Parser(prog="python -m url_lists crawl", add_help=True, allow_abbrev=False,
                     description="Crawl a URL list into a dataset (img2dataset's options and output layout), "
                                 "politely: robots.txt, a rate per site, Retry-After, an honest User-Agent.")
    parser.add_argument("paths", nargs="*", metavar="URL_LIST", help="files, globs (quoted) or folders")
    mine: tuple[tuple[str, dict[str, Any]], ...] = (
        ("url_list", {"help": "a file, glob or folder of URL lists"}),
        ("input_format", {"help": f"one of {', '.join(FORMATS)} (default: each file's extension)"}),
        ("url_col", {"default": "url"}),
        ("caption_col", {}),
        ("save_additional_columns", {"help": "a list ('[\"a\",\"b\"]') or a,b"}),
        ("output_folder", {"default": "images"}),
        ("output_format", {"default": "files", "help": ", ".join(OUTPUT_FORMATS)}),
        ("number_sample_per_shard", {"default": "10000"}),
        ("image_size", {"default": "256", "help": "the longer side of each stored image, in pixels"}),
        ("processes_count", {"default": "1", "help": "workers started on this machine (not with a fleet)"}),
        ("user_agent_token", {"help": "appended to the crawler's identifying User-Agent"}),
        ("incremental_mode", {"default": "incremental", "help": ", ".join(INCREMENTAL_MODES)}),
    )
    for name, extra in mine:
        parser.add_argument(*_spellings(name), dest=name, **extra)
    for name in (*IGNORED, *ONLY_AS_WE_DO):
        # A bare flag is True, as python-fire reads it.
        parser.add_argument(*_spellings(name), dest=name, nargs="?", const="True", default=None,
                            help=argparse.SUPPRESS)
    return parser


def _integer(name: str, raw: Any, low: int, high: int) -> int:
    try:
        value = int(str(raw))
    except ValueError:
        raise OptionError(f"--{name} must be a whole number, not {raw!r}") from None
    if not low <= value <= high:
        raise OptionError(f"--{name} must be between {low} and {high}, not {value}")
    return value


def _names(raw: str | None) -> tuple[str, ...]:
    """A list of column names as img2dataset's users write it: a Python/JSON list, or a,b."""
    if raw is None:
        return ()
    text = raw.strip()
    if text.startswith(("[", "(")):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise OptionError(f"--save_additional_columns: cannot read {raw!r} as a list") from None
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise OptionError("--save_additional_columns must be a list of column names")
        return tuple(value)
    return tuple(part.strip() for part in text.split(",") if part.strip())


def parse(argv: list[str]) -> CrawlOptions:
    """The options, or OptionError with one line; nothing is read or started."""
    args = _parser().parse_args(argv)
    warnings = []
    for name, (accepted, what) in ONLY_AS_WE_DO.items():
        value = getattr(args, name)
        if value is not None and not accepted(value):
            raise OptionError(f"--{name} {value} is not supported: {what}")
    for name, reason in IGNORED.items():
        if getattr(args, name) is not None:
            warnings.append(f"warning: --{name} has no effect here ({reason})")
    paths = tuple(args.paths) + ((args.url_list,) if args.url_list else ())
    if not paths:
        raise OptionError("no URL list: give --url_list (a file, glob or folder)")
    if args.input_format is not None and args.input_format not in FORMATS:
        raise OptionError(f"--input_format {args.input_format} is not supported (use one of {', '.join(FORMATS)})")
    if args.output_format not in OUTPUT_FORMATS:
        raise OptionError(f"--output_format {args.output_format} is not supported "
                          f"(use one of {', '.join(OUTPUT_FORMATS)})")
    if args.incremental_mode not in INCREMENTAL_MODES:
        raise OptionError(f"--incremental_mode {args.incremental_mode} is not supported "
                          f"(use one of {', '.join(INCREMENTAL_MODES)})")
    additional = _names(args.save_additional_columns)
    taken = {args.url_col, args.caption_col}
    clash = [name for name in additional if name in taken]
    if clash:
        raise OptionError(f"--save_additional_columns names {clash[0]}, already the url or caption column")
    token = args.user_agent_token
    if token is not None and (not token.strip() or not token.isprintable()):
        raise OptionError("--user_agent_token must be printable text")
    return CrawlOptions(
        url_list=paths, output_folder=Path(args.output_folder), input_format=args.input_format,
        url_col=args.url_col, caption_col=args.caption_col, save_additional_columns=additional,
        output_format=args.output_format,
        number_sample_per_shard=_integer("number_sample_per_shard", args.number_sample_per_shard, 1, 10_000_000),
        image_size=_integer("image_size", args.image_size, *IMAGE_SIZE_RANGE),
        processes_count=_integer("processes_count", args.processes_count, 1, 256),
        user_agent_token=token.strip() if token else None, incremental_mode=args.incremental_mode,
        warnings=tuple(warnings))
