"""Thumbnail storage: ``{uuid}.jpg`` in S3_BUCKET, through one shared aiobotocore client."""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import AsyncIterator

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session

from common.settings import Settings
from worker.constants import S3_MAX_CONNECTIONS


class S3Thumbnails:
    def __init__(self, client, bucket: str):
        self._client = client
        self._bucket = bucket

    async def put(self, uuid: str, jpeg: bytes) -> None:
        await self._client.put_object(Bucket=self._bucket, Key=f"{uuid}.jpg", Body=jpeg,
                                      ContentType="image/jpeg")


@asynccontextmanager
async def s3_thumbnails(settings: Settings) -> AsyncIterator[S3Thumbnails]:
    # Checksums only where S3 requires them: ~10% less CPU per upload, and S3-compatible
    # stores that predate the flexible-checksum headers accept the requests.
    config = AioConfig(max_pool_connections=S3_MAX_CONNECTIONS, request_checksum_calculation="when_required",
                       response_checksum_validation="when_required")
    async with get_session().create_client("s3", config=config, **settings.s3_client_kwargs()) as client:
        yield S3Thumbnails(client, settings.s3_bucket)
