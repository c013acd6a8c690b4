"""Image analysis on hostile and ordinary files, all generated here with Pillow."""
from __future__ import annotations

import io
import json

import pytest
from PIL import Image, JpegImagePlugin

from test.worker_fakes import exif_jpeg, image_bytes, kill_and_wait, png_bomb
from worker.imaging import webp
from worker.imaging.analysis import BOMB, UNIDENTIFIED, analyze, fitted_size
from worker.imaging.jpeg_quality import estimate_quality
from worker.imaging.pool import ImagePool

TARGET = 64


def thumb(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    assert image.format == "JPEG" and image.mode == "RGB"
    return image


@pytest.mark.parametrize("quality", [1, 3, 10, 20, 30, 50, 75, 90, 95, 100])
def test_jpeg_quality_is_estimated_within_two(quality: int) -> None:
    data = image_bytes("JPEG", (32, 32), quality=quality)
    assert abs(analyze(data, TARGET).compression_quality - quality) <= 2


def test_jpeg_quality_of_grayscale_and_non_jpeg() -> None:
    assert analyze(image_bytes("JPEG", mode="L", color=90, quality=80), TARGET).compression_quality == 80
    assert analyze(image_bytes("PNG"), TARGET).compression_quality is None
    assert estimate_quality({}) is None


def test_dimensions_are_real_width_and_height_and_thumbnail_fits() -> None:
    result = analyze(image_bytes("JPEG", (300, 120)), TARGET)
    assert (result.width, result.height) == (300, 120)
    assert thumb(result.thumbnail).size == (64, 26)
    small = analyze(image_bytes("PNG", (20, 10)), TARGET)
    assert thumb(small.thumbnail).size == (20, 10)  # never enlarged


def test_large_jpeg_uses_draft_mode_and_keeps_true_size() -> None:
    result = analyze(image_bytes("JPEG", (4000, 3000)), 640)
    assert (result.width, result.height) == (4000, 3000)
    assert max(thumb(result.thumbnail).size) == 640


@pytest.mark.parametrize("width, height, target", [
    (1600, 900, 640), (900, 1600, 640), (640, 640, 640), (641, 640, 640), (640, 641, 640), (1, 5000, 640),
    (5000, 1, 640), (1002, 333, 100), (333, 1002, 100), (20, 10, 64), (3, 7, 1), (4000, 3000, 640)])
def test_the_thumbnail_size_is_pillows(width: int, height: int, target: int) -> None:
    image = Image.new("1", (width, height))
    image.thumbnail((target, target))
    assert fitted_size(width, height, target) == image.size


def test_a_wide_jpeg_is_decoded_at_the_dct_scale_its_thumbnail_allows(monkeypatch) -> None:
    """1600 x 900 to 640 x 360: half scale (800 x 450) is still larger; the target square alone
    (900 // 640 = 1) would have decoded it whole."""
    decoded: list[tuple[int, int]] = []
    draft = JpegImagePlugin.JpegImageFile.draft

    def spy(self: JpegImagePlugin.JpegImageFile, mode: str | None, size: tuple[int, int] | None) -> object:
        answer = draft(self, mode, size)
        decoded.append(self.size)
        return answer

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    gradient = Image.linear_gradient("L").resize((1600, 900)).convert("RGB")
    out = io.BytesIO()
    gradient.save(out, "JPEG", quality=95)
    result = analyze(out.getvalue(), 640)
    assert decoded == [(800, 450)]
    assert (result.width, result.height) == (1600, 900)
    thumbnail = thumb(result.thumbnail)
    assert thumbnail.size == (640, 360)
    reference = gradient.resize((640, 360), Image.Resampling.LANCZOS)
    pairs = zip(thumbnail.convert("L").get_flattened_data(), reference.convert("L").get_flattened_data(), strict=True)
    assert max(abs(a - b) for a, b in pairs) <= 8


@pytest.mark.parametrize("data", [
    b"",
    b"<html><body>Not found</body></html>",
    b"\xff\xd8\xff\xe0" + b"\x00" * 100,                  # a JPEG header and nothing else
    image_bytes("PNG", (200, 200))[:300],                  # truncated
    image_bytes("JPEG", (200, 200))[:200],
    bytes(range(256)) * 20,                                # noise
], ids=["zero-bytes", "html", "corrupt-jpeg", "truncated-png", "truncated-jpeg", "noise"])
def test_undecodable_files_are_unidentified_image_errors(data: bytes) -> None:
    result = analyze(data, TARGET)
    assert result.error == UNIDENTIFIED and result.thumbnail == b""


def test_decompression_bomb_is_refused_without_decoding() -> None:
    bomb = png_bomb()
    assert len(bomb) < 200_000
    assert analyze(bomb, TARGET).error == BOMB


def test_cmyk_jpeg_becomes_rgb_thumbnail() -> None:
    result = analyze(image_bytes("JPEG", (100, 80), mode="CMYK", color=(0, 255, 255, 0)), TARGET)
    assert result.error is None and (result.width, result.height) == (100, 80)
    r, g, b = thumb(result.thumbnail).getpixel((10, 10))
    assert r > 200 and g < 60 and b < 60


def test_png_alpha_is_composited_on_white() -> None:
    result = analyze(image_bytes("PNG", (50, 50), mode="RGBA", color=(0, 0, 0, 0)), TARGET)
    assert all(channel > 245 for channel in thumb(result.thumbnail).getpixel((25, 25)))


def test_animated_gif_thumbnail_is_its_first_frame() -> None:
    frames = [Image.new("RGB", (40, 30), color) for color in [(255, 0, 0), (0, 0, 255)]]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    result = analyze(out.getvalue(), TARGET)
    assert (result.width, result.height) == (40, 30)
    r, g, b = thumb(result.thumbnail).getpixel((20, 15))
    assert r > 200 and b < 60


def test_webp_and_palette_transparency() -> None:
    assert analyze(image_bytes("WEBP", (30, 20), quality=80), TARGET).error is None
    palette = Image.new("P", (10, 10), 0)
    out = io.BytesIO()
    palette.save(out, "PNG", transparency=0)
    result = analyze(out.getvalue(), TARGET)
    assert all(channel > 245 for channel in thumb(result.thumbnail).getpixel((5, 5)))


def webp_photo(size: tuple[int, int], mode: str = "RGB", **save) -> bytes:
    """A WebP with detail (a plain colour would hide a decoder's differences), EXIF included."""
    gradient = Image.linear_gradient("L").resize(size)
    bands = [gradient, gradient.rotate(90), Image.effect_noise(size, 60).convert("L")]
    image = Image.merge("RGB", bands).convert(mode)
    exif = Image.Exif()
    exif[0x010F] = "Maker"
    out = io.BytesIO()
    image.save(out, "WEBP", exif=exif, **save)
    return out.getvalue()


@pytest.mark.skipif(not webp.available(), reason="libwebp not found in this process (not Linux?)")
@pytest.mark.parametrize("size, target", [((300, 200), 640), ((1600, 900), 640), ((640, 640), 640), ((50, 70), 64)])
def test_a_still_webp_is_decoded_by_libwebp_to_the_same_analysis(monkeypatch, size, target) -> None:
    """The plain decoder's result is Pillow's, byte for byte: dimensions, EXIF, thumbnail."""
    for save in ({"quality": 80}, {"lossless": True}):
        data = webp_photo(size, **save)
        with Image.open(io.BytesIO(data)) as opened:
            assert webp.decoded(data, opened) is not None  # the fast path is taken
        fast = analyze(data, target)
        with monkeypatch.context() as pillow_only:
            pillow_only.setattr(webp, "decoded", lambda data, image: None)
            assert analyze(data, target) == fast
        assert (fast.width, fast.height) == size and fast.exif == {"0x10f": "Maker"}


def test_webp_with_alpha_or_frames_is_left_to_pillow() -> None:
    """Transparency is composited on white and an animation's first frame is taken, as before."""
    transparent = image_bytes("WEBP", (40, 30), mode="RGBA", color=(0, 0, 0, 0), lossless=True)
    with Image.open(io.BytesIO(transparent)) as opened:
        assert webp.decoded(transparent, opened) is None
    assert all(channel > 245 for channel in thumb(analyze(transparent, TARGET).thumbnail).getpixel((20, 15)))
    frames = [Image.new("RGB", (40, 30), color) for color in [(255, 0, 0), (0, 0, 255)]]
    out = io.BytesIO()
    frames[0].save(out, "WEBP", save_all=True, append_images=frames[1:], duration=100, lossless=True)
    with Image.open(io.BytesIO(out.getvalue())) as opened:
        assert webp.decoded(out.getvalue(), opened) is None
    r, g, b = thumb(analyze(out.getvalue(), TARGET).thumbnail).getpixel((20, 15))
    assert r > 200 and b < 60


def test_sixteen_bit_grayscale_is_scaled_not_clipped() -> None:
    result = analyze(image_bytes("PNG", (20, 20), mode="I;16", color=40_000), TARGET)
    assert 140 < thumb(result.thumbnail).getpixel((5, 5))[0] < 170


def test_exif_is_json_safe_with_hex_keys() -> None:
    exif = analyze(exif_jpeg(), TARGET).exif
    json.dumps(exif, allow_nan=False)
    assert exif["0x13b"] == "Alden Page"
    assert exif["0x10f"] == "Canon"
    assert exif["0x11a"] == 72.0
    assert exif["0x9209"] == 0
    assert exif["0x829d"] == pytest.approx(2.8)
    assert exif["0x9286"] == "hello"
    assert "0x829a" not in exif and "0x927c" not in exif
    assert "0x8769" not in exif  # the pointer itself is an offset, not data
    assert exif["0x8825"] == {"0x1": "N", "0x2": [40.0, 30.0, 7.5]}


def test_image_without_exif_has_none() -> None:
    assert analyze(image_bytes("PNG"), TARGET).exif is None


async def test_process_pool_analyzes_off_the_event_loop() -> None:
    pool = ImagePool(processes=1)
    try:
        result = await pool.analyze(image_bytes("JPEG", (100, 50), quality=90), TARGET)
        assert (result.width, result.height, result.compression_quality) == (100, 50, 90)
        assert (await pool.analyze(b"nope", TARGET)).error == UNIDENTIFIED
    finally:
        pool.close()


async def test_pool_survives_a_crashed_process() -> None:
    pool = ImagePool(processes=1)
    try:
        await pool.analyze(image_bytes("PNG"), TARGET)
        for pid in pool.process_ids():
            kill_and_wait(pid)
        result = await pool.analyze(image_bytes("JPEG", (30, 20)), TARGET)
        assert (result.width, result.height) == (30, 20)
    finally:
        pool.close()


def test_every_libjpeg_quality_is_recovered_exactly_from_its_own_tables() -> None:
    for quality in range(1, 101):  # the tables libjpeg writes, through Pillow's encoder
        with Image.open(io.BytesIO(image_bytes("JPEG", (16, 16), quality=quality))) as written:
            luminance, chrominance = written.quantization[0], written.quantization[1]
        assert estimate_quality({0: luminance, 1: chrominance}) == quality
        assert estimate_quality({0: luminance}) == quality
