"""JPEG quality (1-100) estimated from an image's quantization tables.

Encoders derived from libjpeg (Pillow, most cameras' and editors' "save as
JPEG") scale the two tables of the JPEG standard's Annex K by the quality
setting, so the quality whose scaled tables are nearest to the file's is
the one it was saved with; other encoders get the nearest equivalent. This
replaces the original's ImageMagick dependency with arithmetic.
"""
from __future__ import annotations

from typing import Mapping, Sequence

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
    """The quality whose standard tables differ least from ``tables`` (Pillow's ``quantization``)."""
    present = [(index, list(tables[index])) for index in (0, 1)
               if index in tables and len(tables[index]) == 64]
    if not present:
        return None

    def distance(quality: int) -> int:
        return sum(abs(a - b) for index, table in present
                   for a, b in zip(table, _SCALED[quality][index]))

    # Ties go to the higher quality (the tables bottom out at 1 near 100).
    return min(range(100, 0, -1), key=distance)
