"""WebP pixels by libwebp's plain decoder: the same pixels as Pillow's, for less CPU.

Pillow decodes every WebP through libwebp's animation API: a still image is
decoded into an RGBA canvas, the canvas is copied for the next frame's
disposal, copied again into a Python ``bytes`` and unpacked once more into
the image. ``WebPDecodeRGBAInto`` decodes into a buffer that becomes the
image's own (an ``RGBX`` image mapped on it, no copy), thumbnails byte for byte
identical (docs/decisions.md, "Per-image CPU and the servers' share").

The library is the one Pillow itself loaded (found in ``/proc/self/maps``),
so no other dependency and no second libwebp. Only an opaque still image
takes this path: one with alpha or several frames, a platform without
``/proc``, a library that cannot be found or a decode that fails leave the
image to Pillow, as before.
"""
from __future__ import annotations

import ctypes
import re
from functools import cache

from PIL import Image

_LIBWEBP = re.compile(r"/libwebp(?:-[0-9a-f]+)?\.so[.0-9]*$")  # not libwebpdemux or libwebpmux


@cache
def _library() -> ctypes.CDLL | None:
    """libwebp as Pillow loaded it, with the two functions used here typed; None if not found."""
    try:
        from PIL import _webp  # noqa: F401 - loads libwebp into this process
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if ".so" in line}
        path = next((p for p in sorted(paths) if _LIBWEBP.search(p)), None)
        if path is None:
            return None
        library = ctypes.CDLL(path)
        library.WebPGetInfo.argtypes = [ctypes.c_char_p, ctypes.c_size_t,
                                        ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        library.WebPGetInfo.restype = ctypes.c_int
        library.WebPDecodeRGBAInto.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p,
                                               ctypes.c_size_t, ctypes.c_int]
        library.WebPDecodeRGBAInto.restype = ctypes.c_void_p
        return library
    except (ImportError, OSError, AttributeError):
        return None


def available() -> bool:
    return _library() is not None


def decoded(data: bytes, image: Image.Image) -> Image.Image | None:
    """``image`` (opened from ``data``, not loaded) decoded by libwebp's plain decoder, as an
    ``RGBX`` image (RGB's own layout; its fourth byte is the opaque alpha, ignored); None where
    Pillow must decode it (alpha, frames, no library, a failed decode)."""
    library = _library()
    if library is None or image.mode != "RGB" or getattr(image, "n_frames", 1) != 1:
        return None
    width, height = ctypes.c_int(), ctypes.c_int()
    if not library.WebPGetInfo(data, len(data), ctypes.byref(width), ctypes.byref(height)):
        return None
    if (width.value, height.value) != image.size:
        return None
    stride = width.value * 4
    pixels = bytearray(stride * height.value)
    target = (ctypes.c_char * len(pixels)).from_buffer(pixels)
    try:
        if not library.WebPDecodeRGBAInto(data, len(data), ctypes.addressof(target), len(pixels), stride):
            return None
    finally:
        del target  # the bytearray stays locked while a ctypes view of it exists
    # Mapped on the buffer, not copied (read-only: thumbnail() and convert() make new images).
    return Image.frombuffer("RGBX", image.size, pixels, "raw", "RGBX", 0, 1)
