"""The real-shaped list of the peer bench: LAION's curve, deterministic for a seed, names that resolve nowhere."""
from __future__ import annotations

import pytest

from bench.list_shape import address_of, shape_sites
from url_lists.sites import site_of_host


@pytest.mark.parametrize("urls", [1000, 4000, 10_000])
def test_a_few_sites_hold_a_large_share_and_most_have_one_or_two_urls(urls: int) -> None:
    sites = shape_sites(urls)
    sizes = [site.urls for site in sites]
    assert sum(sizes) == urls and sizes == sorted(sizes, reverse=True)
    assert 0.06 <= sizes[0] / urls <= 0.07                      # the busiest: ~6.5% of the list
    assert sum(sizes[:8]) / urls >= 0.18                       # the head
    assert sum(size <= 2 for size in sizes) / len(sizes) >= 0.75  # the tail: one or two URLs
    assert 0.35 <= len(sites) / urls <= 0.45                   # LAION: 3,800 sites per 10,000 rows


def test_the_issue_s_sample_is_matched_at_10000_rows() -> None:
    sites = shape_sites(10_000)
    assert sites[0].urls == 650 and sum(site.urls == 1 for site in sites) == 3100
    assert 3_700 <= len(sites) <= 4_000


def test_the_same_seed_gives_the_same_list_and_another_seed_another() -> None:
    assert shape_sites(4000, seed=7) == shape_sites(4000, seed=7)
    assert shape_sites(4000, seed=7) != shape_sites(4000, seed=8)


def test_each_host_is_its_own_site_on_its_own_loopback_address_under_a_reserved_tld() -> None:
    sites = shape_sites(4000)
    assert len({site.site for site in sites}) == len({site.address for site in sites}) == len(sites)
    assert all(site_of_host(site.host) == site.site for site in sites)  # the list producer's source
    assert all(site.host.rsplit(".", 1)[1] in ("example", "test") for site in sites)
    assert all(site.address.startswith("127.") for site in sites)


def test_manners_are_mixed_and_the_busiest_site_takes_any_rate() -> None:
    sites = shape_sites(4000)
    busiest, fragile = sites[0], [site for site in sites if site.fragile]
    assert not busiest.fragile and not busiest.disallow_all and 0 < busiest.error_rate < 0.05
    assert 3 <= len(fragile) <= 6 and all(site.urls >= 10 and 2 <= site.slots <= 5 for site in fragile)
    assert all(0.05 <= site.latency <= 0.3 for site in sites)
    assert any(site.disallow_all and site.urls > 50 for site in sites)
    assert sum(site.dead for site in sites) >= 1 and sum(site.error_rate == 1.0 for site in sites) >= 1
    assert not any(site.dead and (site.fragile or site.disallow_all) for site in sites)


@pytest.mark.parametrize("index, address", [(0, "127.41.0.1"), (249, "127.41.0.250"), (250, "127.41.1.1"),
                                            (250 * 256, "127.42.0.1")])
def test_addresses_count_up_from_127_41_0_1(index: int, address: str) -> None:
    assert address_of(index) == address
