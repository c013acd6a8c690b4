"""Thumbnails read back from S3: presigned GETs sent by the image client.

The crawler stored each success's thumbnail under ``contracts.thumbnail_key``; the
collector fetches many at once over keep-alive connections. Each GET is signed as the
worker signs its PUTs (``worker.imaging.thumbnails.PutSigner``, here with only the host signed)
and sent by ``worker.fetching.http_client.HttpClient``: botocore's ``get_object`` cost over a
millisecond of CPU a call, several times this path's.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from common.contracts import thumbnail_key
from common.settings import Settings
from worker.fetching.http_client import BadResponse, BodyTooLarge, Disconnected, HttpClient
from worker.imaging.thumbnails import PutSigner, put_signer, s3_error_code

MAX_THUMBNAIL_BYTES = 32 << 20
GET_TIMEOUT = 60.0
MAX_CONNECTIONS = 32


class GetSigner(PutSigner):
    METHOD = "GET"
    CONTENT_TYPE = None


class StoreUnavailable(Exception):
    """S3 did not give the object nor say it has none (an outage, throttling, credentials): wait and ask again."""


class S3ThumbnailReader:
    def __init__(self, signer: PutSigner, client: HttpClient, connections: int = MAX_CONNECTIONS):
        self._signer = signer
        self._client = client
        self._connections = asyncio.Semaphore(connections)

    async def get(self, identifier: str) -> bytes | None:
        """The thumbnail's bytes; None if the store has no such object."""
        url = await self._signer.url(thumbnail_key(identifier))
        try:
            async with self._connections, asyncio.timeout(GET_TIMEOUT):
                async with self._client.get(url, encoded=True, origin=self._signer.origin) as response:
                    body = await response.read_answer(MAX_THUMBNAIL_BYTES)
                    status = response.status
        except (OSError, TimeoutError, BadResponse, Disconnected, BodyTooLarge) as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None
        if status == 200:
            return body
        code = s3_error_code(body.decode("utf-8", errors="replace")[:2000])
        if status == 404 and code in ("NoSuchKey", ""):
            return None
        raise StoreUnavailable(f"HTTP {status} {code}")


@asynccontextmanager
async def s3_thumbnail_reader(settings: Settings) -> AsyncIterator[S3ThumbnailReader]:
    signer = await put_signer(settings, GetSigner)
    client = HttpClient(settings.crawl_user_agent)  # the store is ours: no SSRF guard
    try:
        yield S3ThumbnailReader(signer, client)
    finally:
        await client.close()
