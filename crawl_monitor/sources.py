"""Source sizes from SOURCES_URL, and the request rate each size earns (SPEC.md §3).

A big site has the infrastructure for a heavy crawl; a small one does not, so
the rate grows linearly with the number of images between two fixed points.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from collections.abc import Callable

import aiohttp

from common.jsonlog import log_event
from common.contracts import EVENT_SOURCES_LOADED, EVENT_SOURCES_UNAVAILABLE
from crawl_monitor.constants import (LARGE_SOURCE_IMAGES, LARGE_SOURCE_RATE, SMALL_SOURCE_IMAGES,
                                     SMALL_SOURCE_RATE, SOURCES_FETCH_TIMEOUT, SOURCES_REFRESH_SECONDS,
                                     SOURCES_RETRY_SECONDS)


class SourcesUnavailable(Exception):
    """The sources list could not be read or held no usable entry."""


def rate_for_size(image_count: int) -> float:
    """Requests per second for a source of ``image_count`` images, clamped at both ends."""
    if image_count <= SMALL_SOURCE_IMAGES:
        return SMALL_SOURCE_RATE
    if image_count >= LARGE_SOURCE_IMAGES:
        return LARGE_SOURCE_RATE
    slope = (LARGE_SOURCE_RATE - SMALL_SOURCE_RATE) / (LARGE_SOURCE_IMAGES - SMALL_SOURCE_IMAGES)
    return SMALL_SOURCE_RATE + (image_count - SMALL_SOURCE_IMAGES) * slope


def parse_source_sizes(data: Any) -> dict[str, int]:
    """Source name (lower-cased, as the splitter names it) -> image count.

    Accepts the old ``image_count`` list, the Openverse stats ``media_count``
    list, or either wrapped in a ``{"results": [...]}`` page. Entries that do
    not fit are skipped: one bad row must not cost every other source its rate.
    """
    if isinstance(data, dict):
        data = data.get("results")
    if not isinstance(data, list):
        raise SourcesUnavailable("expected a list of sources (or a dict with a 'results' list)")
    sizes: dict[str, int] = {}
    for entry in data:
        if not isinstance(entry, dict):
            continue
        name = entry.get("source_name")
        count = entry.get("image_count", entry.get("media_count"))
        if not isinstance(name, str) or not name.strip():
            continue
        if isinstance(count, bool) or not isinstance(count, (int, float)) or count < 0:
            continue
        sizes[name.strip().lower()] = int(count)
    if not sizes:
        raise SourcesUnavailable("the sources list has no entry with a source_name and a count")
    return sizes


async def load_source_sizes(sources_url: str, session: aiohttp.ClientSession) -> dict[str, int]:
    """Read SOURCES_URL, an http(s) URL or a local JSON file (a path or ``file://``)."""
    try:
        if sources_url.startswith(("http://", "https://")):
            timeout = aiohttp.ClientTimeout(total=SOURCES_FETCH_TIMEOUT)
            async with session.get(sources_url, timeout=timeout) as response:
                response.raise_for_status()
                data = await response.json(content_type=None)
        else:
            path = Path(sources_url.removeprefix("file://"))
            data = json.loads(await asyncio.to_thread(path.read_bytes))
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        raise SourcesUnavailable(f"{type(exc).__name__}: {exc}") from None
    return parse_source_sizes(data)


async def refresh_once(sources_url: str, session: aiohttp.ClientSession,
                       adopt: Callable[[dict[str, int]], None]) -> bool:
    """Load the list and hand it to ``adopt``; on failure report it and leave the last rates alone."""
    try:
        sizes = await load_source_sizes(sources_url, session)
    except SourcesUnavailable as exc:
        log_event(EVENT_SOURCES_UNAVAILABLE, sources_url=sources_url, error=str(exc),
                  msg="keeping the last known rates")
        return False
    adopt(sizes)
    log_event(EVENT_SOURCES_LOADED, sources_url=sources_url, count=len(sizes))
    return True


async def refresh_sources(sources_url: str, session: aiohttp.ClientSession,
                          adopt: Callable[[dict[str, int]], None]) -> None:
    """Every 30 minutes; a failed load is retried sooner."""
    while True:
        loaded = await refresh_once(sources_url, session, adopt)
        await asyncio.sleep(SOURCES_REFRESH_SECONDS if loaded else SOURCES_RETRY_SECONDS)
