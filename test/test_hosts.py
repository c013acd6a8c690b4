"""common.hosts: the one host every layer reads out of a URL, and the hosts it refuses."""
from __future__ import annotations

import pytest
from yarl import URL

from common.contracts import InvalidMessage, parse_crawl_request
from common.hosts import (ORIGIN_CACHE_MAX_URL_CHARS, ORIGIN_CACHE_URLS, InvalidHost, forget_origins,
                          normalise_host, origin_cache_info, url_origin)


@pytest.mark.parametrize("host, normalised", [
    ("Example.COM", "example.com"), ("example.com.", "example.com"), ("ß.com", "xn--zca.com"),
    ("xn--zca.com", "xn--zca.com"), ("ｅｘａｍｐｌｅ．ｃｏｍ", "example.com"), ("example。com", "example.com"),
    ("⑫.com", "12.com"), ("cdn_1.example.com", "cdn_1.example.com"),
    ("🯱🯲🯷.0.0.1", "127.0.0.1"), ("１２７．０．０．１", "127.0.0.1"), ("𝟏𝟐𝟕.0.0.1", "127.0.0.1"),
    ("2130706433", "127.0.0.1"), ("0x7f000001", "127.0.0.1"), ("0177.0.0.1", "127.0.0.1"),
    ("0x7f.1", "127.0.0.1"), ("127.1", "127.0.0.1"), ("127.0.1", "127.0.0.1"), ("127.0.0.1.", "127.0.0.1"),
    ("010.0.0.1", "8.0.0.1"), ("0x", "0.0.0.0"), ("4294967295", "255.255.255.255"),
    ("[::1]", "::1"), ("[::FFFF:127.0.0.1]", "::ffff:7f00:1"), ("[0:0::1]", "::1"),
])
def test_normalised_hosts(host, normalised):
    assert normalise_host(host) == normalised


@pytest.mark.parametrize("host", [
    "fe80::1%eth0", "[fe80::1%25eth0]", "%31%32%37.0.0.1", "exa\u00admple.com", "a\u200bb.com",
    "٣.com", "08.0.0.1", "256.1", "1.2.3.4.5", "4294967296", "example.123", "a..b", "-a.com",
    "localhost..", "[1::2::3]", "a" * 64 + ".com", "exa mple.com", "[::1].",
])
def test_refused_hosts(host):
    with pytest.raises(InvalidHost):
        normalise_host(host)


@pytest.mark.parametrize("url", [
    "http://🯱🯲🯷.0.0.1:8080/x.jpg", "HTTP://Example.COM./a", "http://user:pw@ß.com/", "https://[::1]:8443/",
    "http://127.1/", "http://example.com:/", "http://a@b@127.0.0.1/",
])
def test_the_origin_is_yarls_host_normalised(url):
    origin = url_origin(url)
    assert normalise_host(URL(url).raw_host) == origin.host  # what the client and aiohttp connect to
    assert origin.port == URL(url).port


@pytest.mark.parametrize("url", [
    "http://127.0.0.1\\@evil.com/", "http://evil.com\\@127.0.0.1/", "ftp://example.com/", "http:///x",
    "http://example.com:99999/", "http://[fe80::1%25eth0]/",
])
def test_urls_whose_host_is_ambiguous_or_missing_are_refused(url):
    for _asked_again in range(2):  # a refusal is not kept as an answer
        with pytest.raises(InvalidHost):
            url_origin(url)


def test_only_the_origins_of_urls_under_the_size_limit_are_kept():
    short, long = "http://a.example/x", "http://b.example/" + "x" * ORIGIN_CACHE_MAX_URL_CHARS
    forget_origins()
    for url, host in ((long, "b.example"), (short, "a.example"), (long, "b.example"), (short, "a.example")):
        assert url_origin(url).host == host
    assert origin_cache_info() == (1, 1, ORIGIN_CACHE_URLS, 1)  # hits, misses, size, held


def test_the_splitter_rejects_a_host_no_layer_may_read():
    with pytest.raises(InvalidMessage, match="zone id or percent"):
        parse_crawl_request(b'{"url": "http://%31%32%37.0.0.1/x.jpg", "uuid": "u", "source": "s"}')
    # a host that normalises is kept as sent; the worker's guard judges the address it names
    raw = '{"url": "http://\U0001fbf1\U0001fbf2\U0001fbf7.0.0.1/x.jpg", "uuid": "u", "source": "s"}'
    assert parse_crawl_request(raw.encode()).url == "http://\U0001fbf1\U0001fbf2\U0001fbf7.0.0.1/x.jpg"
