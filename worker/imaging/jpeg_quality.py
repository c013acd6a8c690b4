"""JPEG quality (1-100) estimated from an image's quantization tables.

Encoders derived from libjpeg (Pillow, most cameras' and editors' "save as
JPEG") scale the two tables of the JPEG standard's Annex K by the quality
setting, so the quality whose scaled tables are nearest to the file's is
the one it was saved with; other encoders get the nearest equivalent. This
replaces the original's ImageMagick dependency with arithmetic.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

# Annex K tables in natural (row-major) order, as Pillow reports them.
_LUMINANCE = (
    16, 11, 10, 16, 24, 40, 51, 61, 12, 12, 14, 19, 26, 58, 60, 55,
    14, 13, 16, 24, 40, 57, 69, 56, 14, 17, 22, 29, 51, 87, 80, 62,
    18, 22, 37, 56, 68, 109, 103, 77, 24, 35, 55, 64, 81, 104, 113, 92,
    49, 64, 78, 87, 103, 121, 120, 101, 72, 92, 95, 98, 112, 100, 103, 99,
)
_CHROMINANCE = (
    17, 18, 24, 47, 99, 99, 99, 99, 18, 21, 26, 66, 99, 99, 99, 99,
    24, 26, 56, 99, 99, 99, 99, 99, 47, 66, 99, 99, 99, 99, 99, 99,
    *([99] * 32),
)
_STANDARD = (_LUMINANCE, _CHROMINANCE)


def _scaled(table: Sequence[int], quality: int) -> list[int]:
    """libjpeg's jpeg_quality_scaling followed by jpeg_add_quant_table (baseline)."""
    factor = 5000 // quality if quality < 50 else 200 - 2 * quality
    return [min(255, max(1, (value * factor + 50) // 100)) for value in table]


_SCALED = {quality: [_scaled(table, quality) for table in _STANDARD] for quality in range(1, 101)}


def estimate_quality(tables: Mapping[int, Sequence[int]]) -> int | None:
    """The quality whose standard tables differ least from ``tables`` (Pillow's ``quantization``).

    The scale factor of the luminance table gives a first guess; only its neighbourhood is
    searched (a full search of 100 qualities costs ~1 ms of Python per image).
    """
    present = [(index, list(tables[index])) for index in (0, 1)
               if index in tables and len(tables[index]) == 64]
    if not present:
        return None
    guess = _guess(present[0][1], _STANDARD[present[0][0]])

    def distance(quality: int) -> int:
        return sum(abs(a - b) for index, table in present
                   for a, b in zip(table, _SCALED[quality][index], strict=False))

    if guess is None:
        candidates = range(100, 0, -1)
    elif distance(guess) == 0:
        # Tables written by libjpeg (the common case) match their quality exactly: only a tie
        # above it can win (ties go higher, as the tables bottom out at 1 near 100).
        while guess < 100 and distance(guess + 1) == 0:
            guess += 1
        return guess
    else:  # below ~20 most entries clamp at 255 and the guess drifts: search down to 1
        candidates = range(min(100, guess + _SEARCH), 0 if guess <= 20 else guess - _SEARCH, -1)
    # Ties go to the higher quality (the tables bottom out at 1 near 100).
    return min(candidates, key=distance)


_SEARCH = 6


def _guess(table: Sequence[int], standard: Sequence[int]) -> int | None:
    """The quality whose libjpeg scale factor matches the table's median ratio to the standard;
    None when every entry is clamped (1 or 255), as at the extremes."""
    scales = sorted(100.0 * value / base for value, base in zip(table, standard, strict=False) if 1 < value < 255)
    if not scales:
        return None
    scale = scales[len(scales) // 2]
    quality = (200.0 - scale) / 2 if scale <= 100 else 5000.0 / scale
    return min(100, max(1, round(quality)))
