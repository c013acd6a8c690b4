"""Thumbnail uploads against the real S3-compatible store: presigned by aiobotocore, sent by aiohttp."""
from __future__ import annotations

import pytest
from aiobotocore.session import get_session

from common.settings import Settings
from devstack.servers import DEV_CREDENTIALS
from test.conftest import BUCKET
from worker.thumbnails import S3PutFailed, s3_thumbnails


def s3_settings(endpoint: str, bucket: str = BUCKET) -> Settings:
    return Settings(s3_endpoint_url=endpoint, s3_bucket=bucket, aws_access_key_id=DEV_CREDENTIALS["aws_access_key_id"],
                    aws_secret_access_key=DEV_CREDENTIALS["aws_secret_access_key"])


async def test_a_thumbnail_lands_under_its_uuid_as_a_jpeg(s3_endpoint: str, unique: str) -> None:
    body = b"\xff\xd8not really a jpeg, the store does not care\xff\xd9" * 1000
    async with s3_thumbnails(s3_settings(s3_endpoint)) as thumbnails:
        await thumbnails.put(f"thumb-{unique}", body)
        await thumbnails.put(f"thumb-{unique}", body[::-1])  # a retried task overwrites its own
    async with get_session().create_client("s3", endpoint_url=s3_endpoint, **DEV_CREDENTIALS) as s3:
        response = await s3.get_object(Bucket=BUCKET, Key=f"thumb-{unique}.jpg")
        assert await response["Body"].read() == body[::-1]
        assert response["ContentType"] == "image/jpeg"


async def test_a_refused_upload_raises_for_the_task_to_retry(s3_endpoint: str, unique: str) -> None:
    async with s3_thumbnails(s3_settings(s3_endpoint, bucket=f"missing-{unique}")) as thumbnails:
        with pytest.raises(S3PutFailed, match=r"HTTP 40[34]"):
            await thumbnails.put(f"thumb-{unique}", b"jpeg")
