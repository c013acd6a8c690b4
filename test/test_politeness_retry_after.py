"""Retry-After parsing, and the cluster-wide pause it sets."""
from __future__ import annotations

import pytest

from common.contracts import retry_after_key, tokens_key
from worker.politeness.retry_after import (DEFAULT_PAUSE_SECONDS, MAX_PAUSE_SECONDS,
                                           extend_pause, parse_retry_after, pause_seconds)

pytestmark = pytest.mark.paced  # runs by itself, after the rest (pytest.ini)

NOW = 1_700_000_000.0  # Tue, 14 Nov 2023 22:13:20 GMT


@pytest.mark.parametrize("value, seconds", [
    ("5", 5.0), (" 120 ", 120.0), ("0", 0.0),
    ("Tue, 14 Nov 2023 22:13:50 GMT", 30.0),       # IMF-fixdate
    ("Tuesday, 14-Nov-23 22:14:20 GMT", 60.0),     # obsolete RFC 850 form
    ("Tue, 14 Nov 2023 22:00:00 GMT", 0.0),        # in the past: no wait
    ("99999999999", 99999999999.0),                # huge: capped by pause_seconds
    (None, None), ("", None), ("soon", None), ("-5", None), ("1.5", None),
    ("Tue, 14 Nov 2023 22:13:50", None),           # no zone: not an HTTP date
    ("Tue, 99 Nov 2023 22:13:50 GMT", None),
])
def test_parse_retry_after(value, seconds):
    assert parse_retry_after(value, NOW) == seconds


@pytest.mark.parametrize("status, headers, seconds", [
    (429, {"Retry-After": "5"}, 5), (503, {"Retry-After": "10"}, 10),
    (429, {}, DEFAULT_PAUSE_SECONDS), (503, {"Retry-After": "garbage"}, DEFAULT_PAUSE_SECONDS),
    (429, {"Retry-After": "86400"}, MAX_PAUSE_SECONDS),
    (200, {"Retry-After": "5"}, None), (500, {}, None), (404, {}, None),
])
def test_pause_seconds(status, headers, seconds):
    assert pause_seconds(status, headers, NOW) == seconds


async def test_pause_only_ever_extends(redis_client):
    key = retry_after_key("flickr")
    assert await extend_pause(redis_client, "flickr", 5, NOW) == NOW + 5
    assert int(await redis_client.get(key)) == NOW + 5
    await extend_pause(redis_client, "flickr", 2, NOW + 1)   # ends earlier: ignored
    assert int(await redis_client.get(key)) == NOW + 5
    await extend_pause(redis_client, "flickr", 30.2, NOW)    # ends later: wins, rounded up
    assert int(await redis_client.get(key)) == NOW + 31
    assert await redis_client.get(retry_after_key("other")) is None


async def test_a_pause_empties_the_bucket_at_once(redis_client):
    """The monitor applies a pause at its next tick; this second's tokens must not go out."""
    await redis_client.set(tokens_key("flickr"), 40, px=1500)
    await extend_pause(redis_client, "flickr", 5, NOW)
    assert int(await redis_client.get(tokens_key("flickr"))) == 0
    assert 0 < await redis_client.pttl(tokens_key("flickr")) <= 1500  # the monitor's expiry kept
    await extend_pause(redis_client, "quiet", 5, NOW)
    assert await redis_client.get(tokens_key("quiet")) is None  # no bucket: none created
