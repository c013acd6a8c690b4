"""A stored thumbnail as a sample's image: kept byte for byte when it fits the image size.

The crawler's thumbnails are JPEGs at most ``TARGET_RESOLUTION`` on their longer side, so
with ``--image_size`` at least that (the one command sets them equal) an image is written
as it is. Its size is read from the JPEG's frame header, without decoding. A larger one (a
fleet whose workers store larger thumbnails) is shrunk once, off the event loop.
"""
from __future__ import annotations

import asyncio
import io

from PIL import Image

from worker.constants import THUMBNAIL_JPEG_QUALITY

# Start-of-frame markers (baseline, extended, progressive, lossless...): not DHT, JPG or DAC.
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE = frozenset(range(0xD0, 0xDA)) | {0x01}  # RSTn, SOI, EOI, TEM: no length


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a JPEG's frame header; None if ``data`` is not a JPEG this reads."""
    if data[:2] != b"\xff\xd8":
        return None
    at, end = 2, len(data)
    while at + 4 <= end:
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in _STANDALONE:
            at += 2
            continue
        length = int.from_bytes(data[at + 2:at + 4], "big")
        if marker in _SOF:
            if at + 9 > end or length < 7:
                return None
            height = int.from_bytes(data[at + 5:at + 7], "big")
            width = int.from_bytes(data[at + 7:at + 9], "big")
            return width, height
        if length < 2:
            return None
        at += 2 + length
    return None


def _shrink(data: bytes, size: int) -> bytes:
    with Image.open(io.BytesIO(data)) as image:
        image.thumbnail((size, size))
        out = io.BytesIO()
        image.convert("RGB").save(out, "JPEG", quality=THUMBNAIL_JPEG_QUALITY)
        return out.getvalue()


async def fit_image(data: bytes, size: int) -> bytes:
    dimensions = jpeg_size(data)
    if dimensions is not None and max(dimensions) <= size:
        return data
    try:
        return await asyncio.to_thread(_shrink, data, size)
    except (OSError, ValueError, Image.DecompressionBombError):
        return data  # not an image Pillow reads: kept as the crawler stored it
