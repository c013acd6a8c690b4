"""Thumbnail storage: ``{uuid}.jpg`` in S3_BUCKET.

aiobotocore authorizes each upload (a SigV4 presigned PUT, with the
client's current credentials, so instance-role refreshes apply) and a
plain aiohttp session of its own sends it. ``put_object`` would do both,
but its full request pipeline (event hooks, user-agent assembly, endpoint
rules, response parsing) cost ~1.6 ms of the event loop's CPU per
thumbnail against ~0.8 ms this way, and it was the biggest single cost in a
worker's main process during a crawl (py-spy).

The session is not the crawl's: that one refuses private addresses, where
an S3-compatible store usually lives.
"""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

import aiohttp
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session

from common.settings import Settings
from worker.constants import S3_MAX_CONNECTIONS, S3_PRESIGN_SECONDS, S3_PUT_TIMEOUT

CONTENT_TYPE = "image/jpeg"


class S3PutFailed(Exception):
    """The store answered an upload with an error status; the task retries it (``persist``)."""


class S3Thumbnails:
    def __init__(self, client, session: aiohttp.ClientSession, bucket: str):
        self._client = client
        self._session = session
        self._bucket = bucket

    async def put(self, uuid: str, jpeg: bytes) -> None:
        url = await self._client.generate_presigned_url(
            "put_object", Params={"Bucket": self._bucket, "Key": f"{uuid}.jpg", "ContentType": CONTENT_TYPE},
            ExpiresIn=S3_PRESIGN_SECONDS)
        async with self._session.put(url, data=jpeg, headers={"Content-Type": CONTENT_TYPE}) as response:
            if response.status != 200:
                raise S3PutFailed(f"HTTP {response.status}: {(await response.text())[:300]}")
            await response.read()  # the connection goes back to the pool only once drained


@asynccontextmanager
async def s3_thumbnails(settings: Settings) -> AsyncIterator[S3Thumbnails]:
    # SigV4 everywhere (presigned URLs would default to SigV2); checksums only where S3
    # requires them, so S3-compatible stores that predate those headers accept the requests.
    config = AioConfig(max_pool_connections=S3_MAX_CONNECTIONS, signature_version="s3v4",
                       request_checksum_calculation="when_required",
                       response_checksum_validation="when_required")
    connector = aiohttp.TCPConnector(limit=S3_MAX_CONNECTIONS)
    async with get_session().create_client("s3", config=config, **settings.s3_client_kwargs()) as client, \
            aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=S3_PUT_TIMEOUT)) as session:
        yield S3Thumbnails(client, session, settings.s3_bucket)
