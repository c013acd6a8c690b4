"""The demo's sample crawl: three sources of very different sizes serving real photos.

The sizes (300 million, 2 million and 5,000 images) give rates of about 120,
1.8 and 1 request/s, so the summary shows each source held to its own limit.
The small sources get few URLs so the demo ends in a couple of minutes. The
photos are scikit-image's bundled samples, cropped, resized and re-encoded
into every format the crawler meets, some with EXIF, plus dead links and
broken files, all generated deterministically (no download).
"""
from __future__ import annotations

import random
import uuid as uuidlib
from dataclasses import dataclass

import numpy as np
import skimage.data
from PIL import Image

from demo.outcomes import CRAWL_ERRORS, LINK_ROT, OPTED_OUT
from demo.simweb import BROKEN_BODIES, DISALLOW_PRIVATE, Planned, SiteSpec, encode

PHOTOS = ("astronaut", "coffee", "chelsea", "camera", "rocket", "cat", "hubble_deep_field",
          "immunohistochemistry", "moon", "coins", "retina", "colorwheel", "logo", "clock",
          "grass", "brick", "page", "text")
LONG_SIDES = (120, 320, 480, 640, 800, 1024, 1600)
VARIANTS = (("jpg", 35), ("jpg", 60), ("jpg", 75), ("jpg", 85), ("jpg", 95),
            ("png", None), ("gif", None), ("webp", 70))


@dataclass(frozen=True)
class SampleSource:
    name: str
    image_count: int
    urls: int
    latency: float
    robots_txt: str | None = None


SOURCES = (
    SampleSource("bigphotoarchive", 300_000_000, urls=240, latency=0.03),
    SampleSource("citymuseum", 2_000_000, urls=40, latency=0.15, robots_txt=DISALLOW_PRIVATE),
    SampleSource("smallherbarium", 5_000, urls=20, latency=0.3),
)


def _photo(name: str) -> Image.Image:
    array = getattr(skimage.data, name)()
    if array.dtype == bool:
        array = array.astype(np.uint8) * 255
    return Image.fromarray(array)


def variant(rng: random.Random, photos: dict[str, Image.Image]) -> tuple[str, bytes]:
    """A random crop of a random photo at a random size and format."""
    image = photos[rng.choice(PHOTOS)]
    width, height = image.size
    crop_w, crop_h = int(width * rng.uniform(0.5, 1)), int(height * rng.uniform(0.5, 1))
    left, top = rng.randint(0, width - crop_w), rng.randint(0, height - crop_h)
    image = image.crop((left, top, left + crop_w, top + crop_h))
    scale = rng.choice(LONG_SIDES) / max(image.size)
    image = image.resize((max(1, round(crop_w * scale)), max(1, round(crop_h * scale))),
                         Image.Resampling.BILINEAR, reducing_gap=2.0)
    if image.mode not in ("RGB", "L"):
        image = image.convert("RGB")
    ext, quality = rng.choice(VARIANTS)
    artist = "Demo Photographer" if rng.random() < 0.4 else None
    return ext, encode(image, ext, quality, artist=artist)


def truncated(body: bytes) -> bytes:
    return body[: len(body) // 3]


def sample_web(seed: int = 6) -> tuple[list[SiteSpec], list[Planned]]:
    """The three sites and their URLs: ~90% images, then 404s, broken files, robots-disallowed."""
    rng = random.Random(seed)
    photos = {name: _photo(name) for name in PHOTOS}
    specs, plan = [], []
    for source in SOURCES:
        files: dict[str, bytes] = {}
        for k in range(source.urls):
            ext, body = variant(rng, photos)
            roll = k % 20
            if roll == 7:
                path, expect = f"/gone/{k}.jpg", LINK_ROT
            elif roll == 13:
                path, expect = f"/photos/{k}-deleted.jpg", LINK_ROT
            elif roll == 17:
                path, expect = f"/photos/{k}.jpg", CRAWL_ERRORS
                files[path] = rng.choice(BROKEN_BODIES + (truncated(body),))
            elif roll == 3 and source.robots_txt:
                path, expect = f"/private/{k}.{ext}", OPTED_OUT
                files[path] = body
            else:
                path, expect = f"/photos/{k}.{ext}", "quality"
                files[path] = body
            plan.append(Planned(str(uuidlib.uuid4()), source.name, path, frozenset({expect})))
        specs.append(SiteSpec(source.name, source.image_count, files, latency=source.latency,
                              robots_txt=source.robots_txt, seed=seed))
    rng.shuffle(plan)
    return specs, plan
