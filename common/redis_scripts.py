"""Lua scripts over one pipelined connection: the per-request Redis calls.

A worker calls a script per request (its token, ``worker.fetching.tokens``) and per outcome (its
stats, ``worker.outcomes.stats``). Through redis-py each call costs the worker's CPU in layers
(checking a connection out of the pool and its health, the retry wrapper, the packing and
parsing; docs/decisions.md, "Per-image CPU and the servers' share"). Here every
task's ``EVALSHA`` is written to one connection (those of one turn of the event loop in one
write: the write's system call was most of a call's CPU) and its reply matched to it in order
(Redis answers a connection's commands in the order they came), parsed by hiredis: 59-211 us
a call against redis-py's 240-393 (``docs/decisions.md``, "Per-image CPU and the servers' share":
"scripts over one pipelined connection"; the one write a turn: "The worker loop's CPU").

The connection is made from the client's own pool settings (address, TLS, credentials,
database), so a ``REDIS_URL`` means the same here as everywhere else. Replies and errors
are what redis-py would give (``decode_responses``, its exception classes), so callers
and their handling of refusals (``common.redis_client.refuses_the_value``) do not change.
A lost connection fails every call in flight with ``ConnectionError`` and the next call
connects again; the callers wait the outage out and log it (``worker.outcomes.task.persist``), where
redis-py retried such a call itself, unlogged, and could run a script twice. Like redis-py
with the default URL, a reply is waited for without a time limit.
"""
from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import Sequence
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis._parsers.base import BaseParser  # the error-reply -> exception mapping redis-py uses
from redis._parsers.encoders import Encoder
from redis.commands.helpers import list_or_args
from redis.commands.core import AsyncScript
from redis.asyncio.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError


class ScriptPipe:
    """One connection on which any number of tasks' script calls are in flight at once."""

    def __init__(self, pool: aioredis.ConnectionPool):
        self._pool = pool
        self._encoder = pool.get_encoder()  # redis-py's, so a value is sent (or refused) as it would be
        self._connection: _Connection | None = None
        self._connecting = asyncio.Lock()  # one connection, however many callers found none
        self._closed = False

    async def call(self, *args: Any) -> Any:
        """Send one command and return its reply (an error reply raised as redis-py would)."""
        request = pack(args, self._encoder)  # before connecting: a value Redis cannot take is refused at once
        connection = self._connection
        if connection is None or connection.lost:
            connection = await self._connect()
        return await connection.send(request)

    async def _connect(self) -> _Connection:
        async with self._connecting:
            if self._closed:
                raise RedisConnectionError("the script connection is closed")
            if self._connection is None or self._connection.lost:
                self._connection = await _open(self._pool)
            return self._connection

    async def aclose(self) -> None:
        self._closed = True
        if self._connection is not None:
            self._connection.close()


class PipelinedScript:
    """``redis.asyncio`` ``AsyncScript``'s interface, over a ``ScriptPipe``."""

    def __init__(self, owner: aioredis.Redis, pipe: ScriptPipe, script: str):
        self._owner = owner
        self._pipe = pipe
        self.script = script
        self.sha = hashlib.sha1(script.encode()).hexdigest()

    async def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = (), client: Any = None) -> Any:
        """``client``: run on that client or pipeline instead, as redis-py does (its ``Lock``
        keeps the scripts of the first client it met and passes the client of each call)."""
        if client is not None and client is not self._owner:
            return await AsyncScript(client, self.script)(keys=keys, args=args, client=client)
        try:
            return await self._pipe.call("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:  # a new or flushed script cache: EVAL runs the script and caches it
            return await self._pipe.call("EVAL", self.script, len(keys), *keys, *args)


class PipelinedScriptsRedis(aioredis.Redis):
    """redis-py's client, but its registered scripts, MGET, DECRBY and SMISMEMBER run over one pipelined connection."""

    _script_pipe: ScriptPipe | None = None

    def register_script(self, script: str) -> PipelinedScript:  # type: ignore[override]
        return PipelinedScript(self, self._pipe(), script)

    async def mget(self, keys: Any, *args: Any) -> list[Any]:
        """redis-py's ``mget``, on the pipelined connection: a worker's token peeks read this way up
        to 100 times a second, and redis-py's own call cost several times the CPU."""
        names = list_or_args(keys, args)
        return await self._pipe().call("MGET", *names) if names else []  # redis-py's answer to no keys

    async def decrby(self, name: Any, amount: int = 1) -> int:
        """redis-py's ``decrby``, on the pipelined connection: a worker whose loop lags forfeits
        its late tokens this way (``worker.fetching.tokens``), hundreds of times a minute."""
        return await self._pipe().call("DECRBY", name, amount)

    decr = decrby

    async def smismember(self, name: Any, values: Any, *args: Any) -> list[Any]:
        """redis-py's ``smismember`` (1 or 0 a member, as Redis answers), on the pipelined connection:
        the monitor asks it of every source it ticks each second, and redis-py's packing of each
        member was a third of the monitor's Redis calls (docs/decisions.md, "Fleet scale")."""
        return await self._pipe().call("SMISMEMBER", name, *list_or_args(values, args))

    def _pipe(self) -> ScriptPipe:
        if self._script_pipe is None:
            self._script_pipe = ScriptPipe(self.connection_pool)
        return self._script_pipe

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        if self._script_pipe is not None:
            await self._script_pipe.aclose()
        await super().aclose(close_connection_pool)


def pack(args: Sequence[Any], encoder: Encoder) -> bytes:
    """A command in RESP: an array of bulk strings, each value encoded by redis-py's ``encoder``
    (which raises ``DataError`` for a value it cannot send)."""
    parts: list[bytes | bytearray | memoryview] = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = encoder.encode(arg)
        parts += (b"$%d\r\n" % len(data), data, b"\r\n")
    return b"".join(parts)


class _Connection(asyncio.Protocol):
    """A connection and the calls waiting on it, oldest first."""

    def __init__(self, encoding: str | None, errors: str):
        self._reader = hiredis.Reader(encoding=encoding, errors=errors) if encoding else hiredis.Reader()
        self._waiting: deque[asyncio.Future] = deque()
        self._outgoing: list[bytes] = []  # requests of this turn of the event loop, written at its end
        self._transport: asyncio.Transport | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def send(self, request: bytes) -> asyncio.Future:
        if self.lost or self._transport is None:
            raise RedisConnectionError("connection to Redis lost")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiting.append(future)
        if not self._outgoing:
            loop.call_soon(self._flush)
        self._outgoing.append(request)
        return future

    def _flush(self) -> None:
        """The requests sent since the last flush, in order, in one write (one system call)."""
        outgoing, self._outgoing = self._outgoing, []
        if outgoing and not self.lost and self._transport is not None:
            self._transport.write(outgoing[0] if len(outgoing) == 1 else b"".join(outgoing))

    def data_received(self, data: bytes) -> None:
        try:
            self._reader.feed(data)
            while (reply := self._reader.gets()) is not False:
                future = self._waiting.popleft()  # a reply no call waits for is a broken stream
                if future.done():  # its caller was cancelled; the reply is dropped in its turn
                    continue
                if isinstance(reply, hiredis.ReplyError):
                    future.set_exception(BaseParser.parse_error(reply.args[0]))
                else:
                    future.set_result(reply)
        except (hiredis.ProtocolError, IndexError) as exc:
            self._fail(RedisConnectionError(f"Redis protocol error: {exc!r}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"connection to Redis lost: {exc!r}"))

    def close(self) -> None:
        self._fail(RedisConnectionError("connection to Redis closed"))
        if self._transport is not None:
            self._transport.close()

    def _fail(self, error: RedisError) -> None:
        self.lost = True
        self._outgoing = []
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(error)


async def _open(pool: aioredis.ConnectionPool) -> _Connection:
    """Connect as the pool's own connections do: same address, TLS, credentials and database."""
    settings = pool.connection_class(**pool.connection_kwargs)  # never connected: read, not used
    encoder = settings.encoder
    loop = asyncio.get_running_loop()

    def protocol() -> _Connection:
        return _Connection(encoder.encoding if encoder.decode_responses else None, encoder.encoding_errors)

    try:
        async with asyncio.timeout(settings.socket_connect_timeout):
            if isinstance(settings, UnixDomainSocketConnection):
                _, connection = await loop.create_unix_connection(protocol, settings.path)
            else:
                assert isinstance(settings, Connection)  # TCP, or TLS over it (SSLConnection)
                tls = settings.ssl_context.get() if isinstance(settings, SSLConnection) else None
                _, connection = await loop.create_connection(protocol, settings.host, settings.port, ssl=tls)
    except TimeoutError as exc:
        raise RedisTimeoutError(f"connecting to Redis timed out: {exc!r}") from None
    except OSError as exc:
        raise RedisConnectionError(f"cannot connect to Redis: {exc!r}") from None
    try:
        if settings.password is not None:
            credentials = (settings.username, settings.password) if settings.username else (settings.password,)
            await connection.send(pack(("AUTH", *credentials), encoder))
        if settings.db:
            await connection.send(pack(("SELECT", settings.db), encoder))
    except BaseException:
        connection.close()
        raise
    return connection
