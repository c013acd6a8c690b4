"""The shape of a real URL list (LAION-style), as sites: who holds how many URLs, and their manners.

A published list is long-tailed: a few sites (image CDNs, big shops) hold a large
share of the rows, the busiest one ~6.5%, and most sites appear once or twice
(a 10,000-row LAION sample: 3,800 sites, the busiest 650 URLs, 3,100 with one;
see docs/decisions.md). ``shape_sites`` draws such a list's sites, deterministic
for a seed, with real-looking host names under reserved TLDs (``.example``,
``.test``: never a real domain), one loopback address each, and mixed manners:
most answer in 50-300 ms at any rate; a few are fragile (a handful of slots, so
their latency climbs with concurrency); a few forbid everything in robots.txt,
a few answer 500 to everything, a few have no server at all, and the busiest
answers 500 to 2% of requests.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

# The busiest sites' shares of the URLs, busiest first (the head of the curve).
HEAD_SHARES = (0.065, 0.04, 0.03, 0.022, 0.016, 0.012, 0.01, 0.008)
SINGLE_SHARE = 0.31   # sites with one URL, per URL of the list
DOUBLE_SHARE = 0.03   # sites with two URLs, per URL of the list
MIDDLE_MAX_SHARE = 0.006  # the largest site of the middle, as a share of the URLs
FRAGILE_RANKS = (1, 2, 6, 11)  # by size, busiest = 0: the busiest is a CDN that takes any rate
DISALLOW_RANKS = (3, 9)          # a big site that forbids everything, beside small ones
DISALLOW_SHARE, BROKEN_SHARE, DEAD_SHARE = 0.015, 0.005, 0.005  # of the small sites
BUSIEST_ERROR_RATE = 0.02
LATENCY_RANGE = (0.05, 0.3)
FRAGILE_SLOTS, FRAGILE_LATENCY = (2, 3), (0.15, 0.25)  # 8-20 req/s at most

_PREFIXES = ("img", "i", "cdn", "media", "static", "images", "photos", "assets", "pics", "s", "www")
_WORDS = ("shop", "blog", "news", "photo", "travel", "recipe", "auto", "home", "fashion", "tech", "craft",
          "garden", "pet", "art", "sport", "decor", "wedding", "music", "film", "game", "baby", "bike",
          "outdoor", "vintage", "kitchen", "design", "print", "poster", "toy", "book", "cloud", "pixel")
_SUFFIXES = ("cdn", "hub", "site", "world", "daily", "store", "press", "pics", "zone", "mag", "club", "market")
_TLDS = ("example", "test")


@dataclass(frozen=True)
class ShapedSite:
    """One site of the list: its one host, where it listens, its URLs and its manners."""

    host: str            # the host name in the list's URLs
    address: str         # its loopback address (the hosts file's answer)
    urls: int
    latency: float       # seconds a request takes unloaded
    slots: int = 0       # requests served at once (fragile); 0: any number
    error_rate: float = 0.0
    disallow_all: bool = False  # robots.txt: ``Disallow: /`` for every agent
    dead: bool = False   # nothing listens at its address

    @property
    def site(self) -> str:
        """The registrable domain: the host without its first label."""
        return self.host.split(".", 1)[1]

    @property
    def fragile(self) -> bool:
        return self.slots > 0


def site_sizes(urls: int, rng: random.Random) -> list[int]:
    """URLs per site, busiest first, summing to ``urls``: the head's fixed shares, a
    long-tailed middle (3 URLs to ~0.6% of the list), then sites of two and of one."""
    head = [max(3, round(urls * share)) for share in HEAD_SHARES]
    singles, doubles = round(urls * SINGLE_SHARE), round(urls * DOUBLE_SHARE)
    middle_total = urls - sum(head) - singles - 2 * doubles
    if middle_total < 0:
        raise ValueError(f"{urls} URLs are too few for the list's shape")
    largest = max(3, round(urls * MIDDLE_MAX_SHARE))
    middle: list[int] = []
    while middle_total > 0:
        size = min(largest, int(3 / (1.0 - rng.random()) ** (1 / 1.2)), middle_total)  # Pareto, alpha 1.2
        middle.append(size)
        middle_total -= size
    return sorted(head + middle, reverse=True) + [2] * doubles + [1] * singles


def _host_names(count: int, rng: random.Random) -> list[str]:
    names: list[str] = []
    taken: set[str] = set()
    while len(names) < count:
        site = f"{rng.choice(_WORDS)}{rng.choice(_SUFFIXES)}"
        if rng.random() < 0.5:
            site = f"{rng.choice(_WORDS)}-{site}"
        site = f"{site}.{rng.choice(_TLDS)}"
        if site in taken:
            site = f"{site.split('.')[0]}{len(names)}.{site.split('.')[1]}"
        taken.add(site)
        names.append(f"{rng.choice(_PREFIXES)}.{site}")
    return names


def address_of(index: int) -> str:
    """Site ``index``'s loopback address: 127.41.0.1, 127.41.0.2, ... (250 to a /24)."""
    high, low = divmod(index, 250)
    return f"127.{41 + high // 256}.{high % 256}.{1 + low}"


def shape_sites(urls: int, seed: int = 41) -> list[ShapedSite]:
    """The sites of a real-shaped list of ``urls`` rows, busiest first."""
    rng = random.Random(seed)
    sizes = site_sizes(urls, rng)
    hosts = _host_names(len(sizes), rng)
    small = [i for i, size in enumerate(sizes) if size <= 2]
    picked = rng.sample(small, round(len(small) * (DISALLOW_SHARE + BROKEN_SHARE + DEAD_SHARE)))
    n_disallow, n_broken = round(len(small) * DISALLOW_SHARE), round(len(small) * BROKEN_SHARE)
    disallow = set(picked[:n_disallow]) | set(DISALLOW_RANKS)
    broken = set(picked[n_disallow:n_disallow + n_broken])
    dead = set(picked[n_disallow + n_broken:])
    sites = []
    for i, (size, host) in enumerate(zip(sizes, hosts, strict=True)):
        latency = round(rng.uniform(*LATENCY_RANGE), 3)
        slots = 0
        if i in FRAGILE_RANKS:
            slots, latency = rng.choice(FRAGILE_SLOTS), round(rng.uniform(*FRAGILE_LATENCY), 3)
        error_rate = BUSIEST_ERROR_RATE if i == 0 else 1.0 if i in broken else 0.0
        sites.append(ShapedSite(host, address_of(i), size, latency, slots, error_rate,
                                disallow_all=i in disallow, dead=i in dead))
    return sites
