"""Thumbnail uploads: signed as the client would sign them, sent by aiohttp, checked by the real store."""
from __future__ import annotations

import dataclasses
from datetime import datetime

import botocore.auth
import pytest
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session

from common.settings import Settings
from devstack.servers import DEV_CREDENTIALS
from test.conftest import BUCKET
from worker.constants import S3_PRESIGN_SECONDS
from worker.thumbnails import CONTENT_TYPE, S3PutFailed, put_signer, s3_thumbnails


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
    """A wrong secret: the store checks every signature, as AWS does."""
    settings = dataclasses.replace(s3_settings(s3_endpoint), aws_secret_access_key="not-the-secret")
    async with s3_thumbnails(settings) as thumbnails:
        with pytest.raises(S3PutFailed, match=r"HTTP 403"):
            await thumbnails.put(f"thumb-{unique}", b"jpeg")


FROZEN = datetime(2026, 11, 21, 12, 34, 56)


@pytest.mark.parametrize("endpoint", [None, "http://127.0.0.1:8333"], ids=["aws", "s3-compatible"])
async def test_signed_urls_are_the_clients_own_byte_for_byte(monkeypatch, endpoint: str | None) -> None:
    """The signer skips the client's pipeline, not its result: same URL at the same instant."""
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda *args, **kwargs: FROZEN)
    settings = Settings(s3_endpoint_url=endpoint or "", s3_bucket="thumbs", aws_default_region="eu-west-3",
                        aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key="wJalrXUtnFEMI/K7MDENG")
    signer = await put_signer(settings)
    async with get_session().create_client("s3", config=AioConfig(signature_version="s3v4"),
                                           **settings.s3_client_kwargs()) as client:
        for key in ("0b9f6a3e-4b0e-4c8e-9d5a-1f2e3d4c5b6a.jpg", "odd key+é/x.jpg"):
            expected = await client.generate_presigned_url(
                "put_object", Params={"Bucket": "thumbs", "Key": key, "ContentType": CONTENT_TYPE},
                ExpiresIn=S3_PRESIGN_SECONDS)
            assert await signer.url(key) == expected
