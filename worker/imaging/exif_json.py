"""EXIF as a JSON-safe dict for the EXIF message (SPEC.md §1).

Camera and editor metadata is hostile input: binary blobs, NUL padding,
zero denominators, lone surrogates. Downstream stores it as JSON (often
PostgreSQL ``jsonb``, which rejects NUL and NaN), so a value that cannot be
represented faithfully is dropped rather than sent half-broken.
"""
from __future__ import annotations

import math
from numbers import Rational
from typing import Any

from PIL import ExifTags, Image

from worker.constants import MAX_EXIF_VALUE_CHARS

_DROP = object()
_POINTER_TAGS = {int(ExifTags.IFD.Exif), int(ExifTags.IFD.GPSInfo), int(ExifTags.IFD.Interop)}
_USER_COMMENT = 0x9286
_ASCII_PREFIXES = (b"ASCII\0\0\0", b"\0" * 8)  # EXIF's 8-byte character-code header


def exif_to_json(exif: Image.Exif) -> dict[str, Any]:
    """IFD0 and the Exif sub-IFD flattened as the original did; GPS as a nested dict.

    Keys are tag numbers in lower-case hex (``"0x13b"``).
    """
    out: dict[str, Any] = {}
    try:
        tags = dict(exif)
        tags.update(exif.get_ifd(ExifTags.IFD.Exif))
        gps = exif.get_ifd(ExifTags.IFD.GPSInfo)
    except Exception:  # noqa: BLE001 - corrupt offsets inside a hostile EXIF block: keep what parsed
        tags, gps = dict(exif), {}
    for tag, value in tags.items():
        if tag in _POINTER_TAGS or not isinstance(tag, int):
            continue
        if tag == _USER_COMMENT and isinstance(value, bytes):
            value = _strip_charset_header(value)
        converted = _json_value(value)
        if converted is not _DROP:
            out[hex(tag)] = converted
    gps_json = {hex(tag): v for tag, value in gps.items()
                if isinstance(tag, int) and (v := _json_value(value)) is not _DROP}
    if gps_json:
        out[hex(ExifTags.IFD.GPSInfo)] = gps_json
    return out


def _strip_charset_header(value: bytes) -> bytes:
    for prefix in _ASCII_PREFIXES:
        if value.startswith(prefix):
            return value[len(prefix):]
    return value  # UNICODE/JIS comments: decoded below if they happen to be UTF-8


def _json_value(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return _DROP
    if isinstance(value, str):
        return _json_text(value)
    if isinstance(value, (float, Rational)):
        try:
            number = float(value)
        except (ZeroDivisionError, ValueError, OverflowError):
            return _DROP
        return number if math.isfinite(number) else _DROP
    if isinstance(value, (tuple, list)):
        items = [_json_value(item) for item in value]
        return _DROP if any(item is _DROP for item in items) else items
    return _DROP  # nested dicts below the known IFDs, unknown types


def _json_text(text: str) -> Any:
    text = text.replace("\x00", "").strip()
    if len(text) > MAX_EXIF_VALUE_CHARS:
        return _DROP
    try:
        text.encode("utf-8")  # lone surrogates are not valid UTF-8 downstream
    except UnicodeEncodeError:
        return _DROP
    return text
