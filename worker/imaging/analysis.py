"""Decode, measure and thumbnail one downloaded image: the CPU-heavy part of a task.

``analyze`` is a pure function from bytes to an ``Analysis`` so that it can
run in a process pool (worker/imaging/pool.py) and be tested without any server.
It never raises for bad input: an undecodable file or a decompression bomb
is an ``Analysis`` with ``error`` set, because an exception crossing the
process boundary would have to be pickled and classified again.
"""
from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from typing import Any

from PIL import Image

from common.statuses import Status

from worker.imaging import webp
from worker.constants import (MAX_IMAGE_PIXELS, THUMBNAIL_JPEG_QUALITY, THUMBNAIL_REDUCING_GAP,
                              THUMBNAIL_RESAMPLE)
from worker.imaging.exif_json import exif_to_json
from worker.imaging.jpeg_quality import estimate_quality

Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
RESAMPLE = Image.Resampling[THUMBNAIL_RESAMPLE]

UNIDENTIFIED, BOMB = Status.UNIDENTIFIED_IMAGE, Status.DECOMPRESSION_BOMB


@dataclass(frozen=True)
class Analysis:
    width: int = 0
    height: int = 0
    compression_quality: int | None = None
    exif: dict[str, Any] | None = None
    thumbnail: bytes = b""
    error: str | None = None  # UNIDENTIFIED or BOMB; the rest is empty then


def analyze(data: bytes, target_resolution: int) -> Analysis:
    """Measure ``data`` and make a JPEG thumbnail at most ``target_resolution`` on its longer side."""
    try:
        with warnings.catch_warnings():
            # Pillow only warns between 1x and 2x its pixel limit: make that a bomb too.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return _analyze(data, target_resolution)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return Analysis(error=BOMB)
    except MemoryError:
        return Analysis(error=BOMB)
    except Exception:  # noqa: BLE001 - Pillow raises OSError, ValueError, SyntaxError, EOFError... on bad files
        return Analysis(error=UNIDENTIFIED)


def _analyze(data: bytes, target_resolution: int) -> Analysis:
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size  # before draft mode shrinks it
        quality = None
        if image.format in ("JPEG", "MPO"):
            quality = estimate_quality(getattr(image, "quantization", None) or {})
        exif = exif_to_json(image.getexif()) or None
        # An opaque still WebP: the same pixels from libwebp's plain decoder, for less CPU.
        pixels: Image.Image = (webp.decoded(data, image) if image.format == "WEBP" else None) or image
        size = fitted_size(width, height, target_resolution)
        if size == (width, height):
            # Saved unloaded, it would be decoded and then copied whole (Image.save's
            # _ensure_mutable): loaded here.
            pixels.load()
        else:
            # The first frame. A JPEG is decoded at the smallest DCT scale (1/2, 1/4, 1/8) still at
            # least ``size``: thumbnail() asks for one at least the target square, so a 1600 x
            # 1000 photo was decoded whole (docs/decisions.md, "Thumbnails").
            drafted = pixels.draft(None, size)
            pixels = pixels.resize(size, RESAMPLE, box=drafted[1] if drafted else None,
                                   reducing_gap=THUMBNAIL_REDUCING_GAP)
        thumbnail = _encode_jpeg(_to_rgb(pixels))
    return Analysis(width=width, height=height, compression_quality=quality,
                    exif=exif, thumbnail=thumbnail)


def fitted_size(width: int, height: int, target: int) -> tuple[int, int]:
    """The size ``Image.thumbnail((target, target))`` gives a ``width`` x ``height`` image: the
    same aspect within the square, each side rounded to the nearer aspect, at least 1."""
    if width <= target and height <= target:
        return width, height
    aspect = width / height
    if aspect >= 1:
        exact = target / aspect
        sides = (math.floor(exact), math.ceil(exact))
        return target, max(min(sides, key=lambda n: 0 if n == 0 else abs(aspect - target / n)), 1)
    exact = target * aspect
    return max(min((math.floor(exact), math.ceil(exact)), key=lambda n: abs(aspect - n / target)), 1), target


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB for JPEG; transparency composited on white, as a browser shows it on a white page."""
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        image = image.point(lambda value: value / 256) if image.mode.startswith("I;16") else image
        image = image.convert("L")
    return image if image.mode == "RGB" else image.convert("RGB")


def _encode_jpeg(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", quality=THUMBNAIL_JPEG_QUALITY)
    return out.getvalue()
