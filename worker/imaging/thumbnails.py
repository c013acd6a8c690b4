"""Thumbnail storage: ``common.contracts.thumbnail_key(uuid)`` (``{uuid}.jpg`` for a UUID) in S3_BUCKET,
or, with THUMBNAIL_DIR set (one machine: the embedded crawl), the file of that name in the folder
(``ThumbnailFolder``).

Each upload is a SigV4 presigned PUT sent by a client of its own, the image
client's kind (``worker.fetching.http_client``: aiohttp's request machinery cost ~1.5
times its CPU a PUT). ``put_object`` would do both, but its request pipeline (event hooks,
endpoint rules, parameter validation, response parsing) cost ~1.6 ms of the
event loop's CPU per thumbnail, and the client's ``generate_presigned_url``
still runs most of it: 0.18-0.22 ms a URL, against 0.07-0.08 ms for the
signature alone (2,000 URLs, alternating). So the client is asked once, at
start, where objects live (its endpoint rules decide virtual-hosted or path
style, AWS or an S3-compatible store), and each upload is then signed as
botocore's S3 presigner, ``S3SigV4QueryAuth``, signs (``PutSigner``), with
credentials frozen per upload, so that instance-role refreshes apply. A test
holds the two URLs equal.

The URL is sent exactly as it was signed (``HttpClient.put``): by default
yarl re-quotes a URL and resolves its dot segments, so a key with ``../`` in
it was signed for one path and sent to another, in another bucket.
The store's answer says whether it concerns the whole store (credentials,
clock, throttling, the bucket, an outage: ``S3PutFailed``, waited out) or
only this object (``ThumbnailRefused``, the URL's outcome).

The client is not the crawl's: that one resolves through the SSRF guard, which
refuses private addresses, where an S3-compatible store usually lives.
"""
from __future__ import annotations

import asyncio
import errno
import hashlib
import hmac
import os
import re
import secrets
from contextlib import asynccontextmanager
from typing import Any, Protocol
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from aiobotocore.config import AioConfig
from aiobotocore.credentials import AioCredentials
from aiobotocore.session import get_session
import botocore.auth
from botocore.auth import SIGV4_TIMESTAMP, UNSIGNED_PAYLOAD, _host_from_url

from common.contracts import thumbnail_key
from common.hosts import url_origin
from common.settings import Settings
from worker.constants import S3_MAX_ANSWER_BYTES, S3_MAX_CONNECTIONS, S3_PRESIGN_SECONDS, S3_PUT_TIMEOUT
from worker.fetching.http_client import HttpClient

CONTENT_TYPE = "image/jpeg"
_TEMPLATE_KEY = "key-template"


class S3PutFailed(Exception):
    """The store cannot take uploads now (5xx, throttling, credentials, clock skew, no bucket,
    a redirect to another endpoint): every upload would fail alike, so the task waits (``persist``)."""


class ThumbnailRefused(Exception):
    """The store refused this one object (a 4xx about the request): the URL's outcome, not an outage."""

    def __init__(self, status: int | None, code: str, message: str):
        super().__init__(f"HTTP {status} {code}: {message}" if status is not None else f"{code}: {message}")
        self.status = status
        self.code = code


# 4xx answers that are about the store, not the object: the credentials, the clock, the bucket,
# a slow connection or throttling (S3's error codes; 401, 403, 408 and 429 whatever the code).
# Every other upload would get the same answer, so these are waited out like a 5xx.
STORE_WIDE_STATUSES = frozenset({401, 403, 408, 429})
STORE_WIDE_CODES = frozenset({
    "AccessDenied", "AccountProblem", "AllAccessDisabled", "AuthorizationHeaderMalformed",
    "AuthorizationQueryParametersError", "ExpiredToken", "InvalidAccessKeyId", "InvalidToken",
    "NoSuchBucket", "OperationAborted", "RequestTimeTooSkewed", "RequestTimeout", "SignatureDoesNotMatch",
    "SlowDown", "Throttling", "ThrottlingException", "TokenRefreshRequired", "TooManyRequests",
    "RequestLimitExceeded", "InvalidBucketState", "ServiceUnavailable", "InternalError",
})
_ERROR_CODE = re.compile(r"<Code>([^<]{1,100})</Code>")


def s3_error_code(body: str) -> str:
    """The ``<Code>`` of an S3 error document; "" if there is none."""
    found = _ERROR_CODE.search(body)
    return found.group(1) if found else ""


def concerns_the_object(status: int, code: str) -> bool:
    """Whether an S3 answer to a PUT refuses this object only (a 4xx that is not about
    credentials, the clock, the bucket or throttling). 3xx (another region or endpoint) and
    5xx concern every upload."""
    return 400 <= status < 500 and status not in STORE_WIDE_STATUSES and code not in STORE_WIDE_CODES


class PutSigner:
    """Presigned PUT URLs for keys of one bucket, exactly as the client would make them.

    Botocore's ``S3SigV4QueryAuth``, written out for the one request shape signed here
    (a PUT with a ``Content-Type``, no query of its own; a subclass signs GETs with only the
    host, ``url_lists.dataset.s3``): what varies per URL is the key, the instant and the
    credentials, so the host, the canonical headers and, per day and secret, the signing key
    are made once. Botocore's signer built an ``AWSRequest`` and
    parsed its URL back several times: ~10% of a worker's event loop in a crawl. A test
    holds the URLs equal to the client's own, byte for byte, with and without a token.
    """

    METHOD = "PUT"
    CONTENT_TYPE: str | None = CONTENT_TYPE  # a signed header; None: only the host is signed

    def __init__(self, template_url: str, credentials: Any, region: str):
        scheme, netloc, path, _query, _fragment = urlsplit(template_url)
        if not path.endswith(_TEMPLATE_KEY):
            raise ValueError(f"unexpected presigned URL shape: {template_url[:200]}")
        self._base = (scheme, netloc, path[:-len(_TEMPLATE_KEY)])
        self.origin = url_origin(template_url)  # that of every URL signed here
        self._credentials = credentials
        self._region = region
        typed = "" if self.CONTENT_TYPE is None else f"content-type:{self.CONTENT_TYPE}\n"
        self._headers = f"{typed}host:{_host_from_url(template_url)}\n"
        self._signed = "host" if self.CONTENT_TYPE is None else _SIGNED_HEADERS
        self._signed_query = f"&X-Amz-SignedHeaders={_encode(self._signed)}"  # a query value
        self._signing_key: tuple[str, str, bytes] = ("", "", b"")  # (day, secret, key)

    async def url(self, key: str) -> str:
        """The presigned URL, percent-encoded as signed: send it with ``yarl.URL(url, encoded=True)``."""
        scheme, netloc, prefix = self._base
        path = prefix + quote(key, safe="/~")
        frozen = await self._credentials.get_frozen_credentials()
        timestamp = botocore.auth.get_current_datetime().strftime(SIGV4_TIMESTAMP)
        scope = f"{timestamp[:8]}/{self._region}/s3/aws4_request"
        query = (f"X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={_encode(f'{frozen.access_key}/{scope}')}"
                 f"&X-Amz-Date={timestamp}&X-Amz-Expires={S3_PRESIGN_SECONDS}")
        token = "" if frozen.token is None else f"&X-Amz-Security-Token={_encode(frozen.token)}"
        # The canonical query is sorted by name: the token comes before SignedHeaders.
        signed = self._signed_query
        canonical = (f"{self.METHOD}\n{path}\n{query}{token}{signed}\n{self._headers}\n{self._signed}\n"
                     f"{UNSIGNED_PAYLOAD}")
        to_sign = f"AWS4-HMAC-SHA256\n{timestamp}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
        signature = hmac.new(self._key(timestamp[:8], frozen.secret_key), to_sign.encode(), hashlib.sha256).hexdigest()
        return urlunsplit((scheme, netloc, path, f"{query}{signed}{token}&X-Amz-Signature={signature}", ""))

    def _key(self, day: str, secret: str) -> bytes:
        if self._signing_key[:2] != (day, secret):
            key = ("AWS4" + secret).encode()
            for part in (day, self._region, "s3", "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            self._signing_key = (day, secret, key)
        return self._signing_key[2]


_SIGNED_HEADERS = "content-type;host"


def _encode(value: str) -> str:
    """A query value as botocore's ``percent_encode`` writes it."""
    return quote(value.encode(), safe="-_.~")


class ThumbnailStore(Protocol):
    """Where thumbnails go (S3, a folder on this machine, a dict in the unit tests)."""

    async def put(self, uuid: str, jpeg: bytes) -> None: ...


class S3Thumbnails:
    def __init__(self, signer: PutSigner, client: HttpClient):
        self._signer = signer
        self._client = client
        self._connections = asyncio.Semaphore(S3_MAX_CONNECTIONS)

    async def put(self, uuid: str, jpeg: bytes) -> None:
        url = await self._signer.url(thumbnail_key(uuid))
        async with self._connections, asyncio.timeout(S3_PUT_TIMEOUT):
            status, answer = await self._client.put(url, jpeg, CONTENT_TYPE, S3_MAX_ANSWER_BYTES,
                                                    origin=self._signer.origin)
        if status == 200:
            return
        body = answer.decode("utf-8", errors="replace")[:2000]
        code = s3_error_code(body)
        if concerns_the_object(status, code):
            raise ThumbnailRefused(status, code, body[:300])
        raise S3PutFailed(f"HTTP {status} {code}: {body[:300]}")


async def put_signer(settings: Settings, kind: type[PutSigner] = PutSigner) -> PutSigner:
    """Ask the client once where the bucket's objects live; take credentials as it does
    (``s3_client_kwargs``: the settings' key pair if set, else the default chain)."""
    session = get_session()
    client_kwargs = settings.s3_client_kwargs()
    # SigV4 everywhere (presigned URLs would default to SigV2).
    config = AioConfig(signature_version="s3v4")
    async with session.create_client("s3", config=config, **client_kwargs) as client:
        template = await client.generate_presigned_url(
            "put_object", Params={"Bucket": settings.s3_bucket, "Key": _TEMPLATE_KEY})
        region = client.meta.region_name
    if "aws_access_key_id" in client_kwargs:  # the same key pair the client was given
        credentials = AioCredentials(client_kwargs["aws_access_key_id"], client_kwargs["aws_secret_access_key"])
    else:
        credentials = await session.get_credentials()
    if credentials is None:
        raise RuntimeError("no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                           "or give the machine an instance role")
    return kind(template, credentials, region)


@asynccontextmanager
async def s3_thumbnails(settings: Settings) -> AsyncIterator[S3Thumbnails]:
    signer = await put_signer(settings)
    client = HttpClient(settings.crawl_user_agent)  # the store is ours: no guard (see above)
    try:
        yield S3Thumbnails(signer, client)
    finally:
        await client.close()


def thumbnail_path(folder: Path, identifier: str) -> Path:
    """The file of ``identifier``'s thumbnail in ``folder``: its ``thumbnail_key``, which holds no
    separator and always ends in ``.jpg`` (never ``.`` nor ``..``), so it names a file in ``folder``."""
    key = thumbnail_key(identifier)
    if "/" in key or os.sep in key or "\0" in key or key in (".", ".."):
        raise ValueError(f"thumbnail key {key[:200]!r} would leave the folder")
    return folder / key


class ThumbnailFolder:
    """Thumbnails as files in one folder of this machine: written by the workers, read (then
    deleted) by the dataset collector. Each file is written under a temporary name in the same
    folder (``.{random}.tmp``: never a key, which ends in ``.jpg``) and renamed into place, so a
    reader sees a whole thumbnail or none. No fsync: the files outlive a killed process, not a
    power cut (docs/decisions.md, "Thumbnails in a local folder"). The calls are a few
    microseconds of page-cache I/O, made on the caller's thread."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    async def put(self, uuid: str, jpeg: bytes) -> None:
        """Raises ThumbnailRefused for a name the file system refuses (too long); any other
        OSError (a full or read-only disk) concerns every thumbnail and is waited out."""
        try:
            path = thumbnail_path(self.folder, uuid)
        except ValueError as exc:
            raise ThumbnailRefused(None, "BadKey", str(exc)) from None
        temporary = self.folder / f".{secrets.token_hex(8)}.tmp"
        try:
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                view = memoryview(jpeg)
                while view:
                    view = view[os.write(descriptor, view):]
            finally:
                os.close(descriptor)
            os.replace(temporary, path)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            if exc.errno == errno.ENAMETOOLONG:
                raise ThumbnailRefused(None, "ENAMETOOLONG", f"file name too long ({len(path.name)} bytes)") from None
            raise

    async def get(self, identifier: str) -> bytes | None:
        """The thumbnail's bytes; None if there is no such file (an OSError otherwise)."""
        try:
            return thumbnail_path(self.folder, identifier).read_bytes()
        except FileNotFoundError:
            return None

    def discard(self, identifiers: Iterable[str]) -> None:
        """Delete these thumbnails' files (those already gone are skipped)."""
        for identifier in identifiers:
            thumbnail_path(self.folder, identifier).unlink(missing_ok=True)


@asynccontextmanager
async def thumbnail_store(settings: Settings) -> AsyncIterator[ThumbnailStore]:
    """THUMBNAIL_DIR's folder if set, else S3_BUCKET."""
    if settings.thumbnail_dir:
        yield ThumbnailFolder(Path(settings.thumbnail_dir))
        return
    async with s3_thumbnails(settings) as store:
        yield store
