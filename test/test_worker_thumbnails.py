"""Thumbnail uploads: signed as the client would sign them, sent by the image client, checked by the real store."""
from __future__ import annotations

import dataclasses
from datetime import datetime

from urllib.parse import urlsplit

import botocore.auth
import pytest
from aiohttp import web
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session

from common.hosts import url_origin
from common.settings import Settings
from devstack.servers import DEV_CREDENTIALS
from test.conftest import BUCKET
from worker.constants import S3_PRESIGN_SECONDS
from worker.fetching.http_client import HttpClient
from worker.imaging.thumbnails import (CONTENT_TYPE, S3PutFailed, S3Thumbnails, ThumbnailRefused, concerns_the_object,
                               put_signer, s3_error_code, s3_thumbnails)


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
@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzEXAMPLE/+token=="], ids=["keys", "session-token"])
async def test_signed_urls_are_the_clients_own_byte_for_byte(monkeypatch, endpoint: str | None,
                                                             token: str | None) -> None:
    """The signer skips the client's pipeline, not its result: same URL at the same instant.
    With a session token (the default chain: an instance role, say), the token is signed too."""
    monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda *args, **kwargs: FROZEN)
    keys = {"aws_access_key_id": "AKIDEXAMPLE", "aws_secret_access_key": "wJalrXUtnFEMI/K7MDENG"}
    if token is not None:  # taken from the environment, as from any credential provider
        for name, value in (("AWS_ACCESS_KEY_ID", keys["aws_access_key_id"]),
                            ("AWS_SECRET_ACCESS_KEY", keys["aws_secret_access_key"]),
                            ("AWS_SESSION_TOKEN", token)):
            monkeypatch.setenv(name, value)
        keys = {}
    settings = Settings(s3_endpoint_url=endpoint or "", s3_bucket="thumbs", aws_default_region="eu-west-3",
                        **keys)
    signer = await put_signer(settings)
    async with get_session().create_client("s3", config=AioConfig(signature_version="s3v4"),
                                           **settings.s3_client_kwargs()) as client:
        for key in ("0b9f6a3e-4b0e-4c8e-9d5a-1f2e3d4c5b6a.jpg", "odd key+é/x.jpg"):
            expected = await client.generate_presigned_url(
                "put_object", Params={"Bucket": "thumbs", "Key": key, "ContentType": CONTENT_TYPE},
                ExpiresIn=S3_PRESIGN_SECONDS)
            assert ("X-Amz-Security-Token=" in expected) is (token is not None)
            assert await signer.url(key) == expected
            assert signer.origin == url_origin(expected)  # where each upload connects to


@pytest.mark.parametrize("status, code, the_object", [
    (400, "InvalidRequest", True), (400, "KeyTooLongError", True), (400, "InvalidArgument", True),
    (411, "MissingContentLength", True), (413, "EntityTooLarge", True), (400, "", True),
    (403, "SignatureDoesNotMatch", False), (403, "AccessDenied", False), (403, "RequestTimeTooSkewed", False),
    (400, "ExpiredToken", False), (400, "RequestTimeout", False), (404, "NoSuchBucket", False),
    (429, "", False), (503, "SlowDown", False), (500, "InternalError", False), (301, "PermanentRedirect", False),
    (400, "AuthorizationHeaderMalformed", False), (409, "OperationAborted", False),
])
def test_only_a_4xx_about_the_object_is_the_urls_outcome(status: int, code: str, the_object: bool) -> None:
    """Credentials, the clock, the bucket, throttling, redirects and 5xx would fail every upload alike."""
    assert concerns_the_object(status, code) is the_object


def test_the_error_code_is_read_from_the_s3_error_document() -> None:
    body = '<?xml version="1.0"?><Error><Code>KeyTooLongError</Code><Message>Your key is too long.</Message></Error>'
    assert s3_error_code(body) == "KeyTooLongError" and s3_error_code("<html>gateway</html>") == ""


async def test_a_key_the_store_refuses_is_refused_not_retried(s3_endpoint: str) -> None:
    """A key past the store's 255 bytes (the splitter refuses such identifiers): a 400 about the object."""
    async with s3_thumbnails(s3_settings(s3_endpoint)) as thumbnails:
        with pytest.raises(ThumbnailRefused) as refused:
            await thumbnails.put("a" * 300, b"jpeg")
    assert refused.value.status == 400 and refused.value.code == "KeyTooLongError"


async def test_the_url_sent_is_byte_for_byte_the_url_signed() -> None:
    """yarl would re-quote the URL and resolve its dot segments; the request line must carry the
    signed path and query as they are (the credential's ``%2F`` stays encoded too)."""
    seen: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.raw_path)
        return web.Response(status=200)
    app = web.Application()
    app.router.add_route("PUT", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        settings = Settings(s3_endpoint_url=f"http://127.0.0.1:{port}", s3_bucket="thumbs",
                            aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key="secret")
        signer = await put_signer(settings)
        signed: list[str] = []
        sign = signer.url

        async def recording(key: str) -> str:
            signed.append(await sign(key))
            return signed[-1]
        signer.url = recording  # type: ignore[method-assign]
        client = HttpClient("test")
        try:
            thumbnails = S3Thumbnails(signer, client)
            for identifier in ("../../other/owned", "a/./b", "a!b", "\uff0e\uff0e\uff0fx"):
                await thumbnails.put(identifier, b"jpeg")
        finally:
            await client.close()
    finally:
        await runner.cleanup()
    assert seen == [f"{urlsplit(url).path}?{urlsplit(url).query}" for url in signed]
    assert seen[0].startswith("/thumbs/..%212F..%212Fother%212Fowned.jpg?") and "%2F" in seen[0]
