"""The computed rate and the sources list (SPEC.md §3): both schemas, from a file and over HTTP."""
from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from crawl_monitor.sources import (SourcesUnavailable, load_source_sizes, parse_source_sizes,
                                   rate_for_size, refresh_once)

IMAGE_COUNT = [{"source_name": "flickr", "image_count": 450_000_000},
               {"source_name": "Met", "image_count": 375_000, "display_name": "The Met"}]
MEDIA_COUNT = [{"source_name": "flickr", "media_count": 450_000_000, "logo_url": None},
               {"source_name": "met", "media_count": 375_000}]


@pytest.mark.parametrize("images, rate", [
    (0, 1.0), (4_999, 1.0), (5_000, 1.0),
    (500_000_000, 200.0), (500_000_001, 200.0), (10**12, 200.0),
    (250_002_500, 100.5),  # the midpoint of the two fixed points
])
def test_rate_is_linear_between_the_fixed_points_and_clamped_beyond(images: int, rate: float) -> None:
    assert rate_for_size(images) == pytest.approx(rate)


def test_rate_grows_just_past_the_small_end() -> None:
    assert 1.0 < rate_for_size(5_001) < 1.001
    assert 199.999 < rate_for_size(499_999_999) < 200.0


@pytest.mark.parametrize("data", [IMAGE_COUNT, MEDIA_COUNT, {"results": MEDIA_COUNT, "page_count": 1}])
def test_both_schemas_and_a_results_page_are_read(data) -> None:
    assert parse_source_sizes(data) == {"flickr": 450_000_000, "met": 375_000}


def test_entries_that_do_not_fit_are_skipped_not_fatal() -> None:
    data = [*IMAGE_COUNT, "junk", {"source_name": "x"}, {"source_name": "", "image_count": 5},
            {"source_name": "neg", "image_count": -1}, {"source_name": "b", "image_count": True},
            {"image_count": 7}, {"source_name": "s", "media_count": "many"}]
    assert parse_source_sizes(data) == {"flickr": 450_000_000, "met": 375_000}


@pytest.mark.parametrize("data", [[], {"detail": "rate limited"}, "text", None, [{"x": 1}]])
def test_a_list_with_nothing_usable_is_a_failure(data) -> None:
    with pytest.raises(SourcesUnavailable):
        parse_source_sizes(data)


@pytest.mark.parametrize("schema", [IMAGE_COUNT, MEDIA_COUNT])
async def test_sources_from_a_local_file(tmp_path: Path, schema) -> None:
    path = tmp_path / "sources.json"
    path.write_text(json.dumps(schema))
    async with aiohttp.ClientSession() as session:
        assert await load_source_sizes(str(path), session) == {"flickr": 450_000_000, "met": 375_000}
        assert await load_source_sizes(f"file://{path}", session) == {"flickr": 450_000_000, "met": 375_000}


async def _serve(routes: dict[str, web.Response]) -> tuple[web.AppRunner, str]:
    """A local HTTP server (127.0.0.1) answering each path with its canned response."""
    async def handle(request: web.Request) -> web.Response:
        return routes[request.path]

    app = web.Application()
    for path in routes:
        app.router.add_get(path, handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def test_sources_over_http_in_both_schemas_and_failures() -> None:
    runner, base = await _serve({
        "/v1/sources": web.json_response(IMAGE_COUNT),
        "/v1/images/stats/": web.json_response(MEDIA_COUNT),
        "/broken": web.Response(status=500, text="oops"),
        "/html": web.Response(text="<html>maintenance</html>", content_type="text/html"),
    })
    try:
        async with aiohttp.ClientSession() as session:
            assert await load_source_sizes(f"{base}/v1/sources", session) == {"flickr": 450_000_000, "met": 375_000}
            assert await load_source_sizes(f"{base}/v1/images/stats/", session) == {
                "flickr": 450_000_000, "met": 375_000}
            for path in ("/broken", "/html", "/missing"):
                with pytest.raises(SourcesUnavailable):
                    await load_source_sizes(f"{base}{path}", session)
    finally:
        await runner.cleanup()


async def test_a_failed_refresh_keeps_the_last_known_rates(tmp_path: Path, capsys) -> None:
    path = tmp_path / "sources.json"
    path.write_text(json.dumps(IMAGE_COUNT))
    adopted: list[dict[str, int]] = []
    async with aiohttp.ClientSession() as session:
        assert await refresh_once(str(path), session, adopted.append) is True
        path.write_text("{not json")
        assert await refresh_once(str(path), session, adopted.append) is False
        assert await refresh_once(str(tmp_path / "gone.json"), session, adopted.append) is False
    assert adopted == [{"flickr": 450_000_000, "met": 375_000}]
    events = [json.loads(line)["event"] for line in capsys.readouterr().out.splitlines()]
    assert events == ["sources_loaded", "sources_unavailable", "sources_unavailable"]
