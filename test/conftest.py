"""Session-scoped real servers for the suite.

Each server comes from the dev stack (the same code ``make demo`` uses)
unless its setting is in the environment: ``REDIS_URL``, ``KAFKA_HOSTS`` or
``S3_ENDPOINT_URL`` points the run at an external server instead. A server
that cannot be had fails the tests that need it; nothing is skipped.

Isolation on shared servers: Redis is flushed before each test that asks
for it (point ``REDIS_URL`` at a spare database); Kafka and S3 are shared,
so tests use unique source names and uuids (``unique`` fixture) and filter
what they read by them.
"""
from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path
from collections.abc import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from devstack.servers import (DEV_CREDENTIALS, create_bucket,  # noqa: E402
                              kafka_server, redis_server, s3_server)
from devstack.stack import LOCAL_ENV  # noqa: E402

BUCKET = "cc-image-analysis"


_config = None


def pytest_configure(config) -> None:
    global _config
    _config = config


def announce(message: str) -> None:
    """Say which real server the run uses: pytest's reporter writes past its capture."""
    reporter = _config.pluginmanager.get_plugin("terminalreporter") if _config else None
    capture = _config.pluginmanager.get_plugin("capturemanager") if _config else None
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"[servers] {message}")
    else:
        sys.__stderr__.write(f"[servers] {message}\n")


def _serve(make, tmp_path_factory, name: str) -> Iterator[str]:
    server, address = make(tmp_path_factory.mktemp(name))
    server.start()
    try:
        server.wait_ready()
        announce(f"started {server.name} at {address} (pid {server.process.pid})")
        yield address
    finally:
        server.stop()
        announce(f"stopped {server.name}")


@pytest.fixture(scope="session")
def redis_server_url(tmp_path_factory) -> Iterator[str]:
    if os.environ.get("REDIS_URL"):
        announce(f"using external Redis {os.environ['REDIS_URL']}")
        yield os.environ["REDIS_URL"]
    else:
        yield from _serve(redis_server, tmp_path_factory, "valkey")


@pytest.fixture(scope="session")
def kafka_hosts(tmp_path_factory) -> Iterator[str]:
    if os.environ.get("KAFKA_HOSTS"):
        announce(f"using external Kafka {os.environ['KAFKA_HOSTS']}")
        yield os.environ["KAFKA_HOSTS"]
    else:
        yield from _serve(kafka_server, tmp_path_factory, "tansu")


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory) -> Iterator[str]:
    if os.environ.get("S3_ENDPOINT_URL"):
        announce(f"using external S3 {os.environ['S3_ENDPOINT_URL']}")
        create_bucket(os.environ["S3_ENDPOINT_URL"], BUCKET)
        yield os.environ["S3_ENDPOINT_URL"]
    else:
        yield from _serve(lambda d: s3_server(d, bucket=BUCKET), tmp_path_factory, "seaweedfs")


@pytest.fixture
async def redis_url(redis_server_url: str) -> str:
    """The Redis URL, its database flushed for this test."""
    import redis.asyncio as aioredis
    client = aioredis.from_url(redis_server_url)
    try:
        await client.flushdb()
    finally:
        await client.aclose()
    return redis_server_url


@pytest.fixture
async def redis_client(redis_url: str):
    """The client the processes use (``common.redis_client``), on the test server."""
    from common.redis_client import bounded_redis
    client = bounded_redis(redis_url, 16)
    yield client
    await client.aclose()


@pytest.fixture
def unique() -> str:
    """A suffix for source names, uuids and group ids that no other test uses."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
def stack_env(redis_url: str, kafka_hosts: str, s3_endpoint: str) -> dict[str, str]:
    """Environment for a monitor or worker subprocess on the test servers."""
    return {
        **LOCAL_ENV,  # the local stack's settings; an external Kafka's, if given, win
        **os.environ,
        "REDIS_URL": redis_url,
        "KAFKA_HOSTS": kafka_hosts,
        "S3_ENDPOINT_URL": s3_endpoint,
        "S3_BUCKET": BUCKET,
        "AWS_ACCESS_KEY_ID": DEV_CREDENTIALS["aws_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": DEV_CREDENTIALS["aws_secret_access_key"],
        "AWS_DEFAULT_REGION": DEV_CREDENTIALS["region_name"],
        "CRAWL_ALLOW_PRIVATE_NETWORKS": "true",
        "MONITOR_PORT": "0",
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
        "PYTHONUNBUFFERED": "1",
    }
