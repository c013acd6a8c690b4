"""The image HTTP client against raw TCP servers that send crafted bytes.

``worker.fetching.http_client`` parses HTTP/1.1 from the open web itself: every byte a
server sends is untrusted, and a parser that believes the wrong length, hangs
on a silent peer or buffers a never-ending head is a crawler that stores
truncated images, stalls, or runs out of memory. aiohttp's test server would
only ever send well-formed answers, so these servers write bytes by hand, as
a broken or hostile website would: bad framing, lies about lengths, endless
heads, silence, trickles, resets, and connections closed at the worst moment.
"""
from __future__ import annotations

import asyncio
import gzip
import random
import re
import socket
import ssl
import struct
import subprocess
import threading
import time
import tracemalloc
import zlib
from collections.abc import Awaitable, Callable

import pytest

from worker.fetching.http_client import (BadResponse, BodyTooLarge, ConnectFailed, Disconnected, HttpClient,
                                Response, Timeouts)
from worker.politeness import Refused
from worker.fetching.shared_memory import SegmentPool

USER_AGENT = "cc-image-crawler/1.0 (+https://example.org/bot)"
MAX = 64 << 10  # the size cap of most tests

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


# --- raw servers -------------------------------------------------------------
class RawServer:
    """A TCP server on 127.0.0.1 that runs ``handler(reader, writer)`` for each connection
    and counts the connections it accepted."""

    def __init__(self, handler: Handler):
        self._handler = handler
        self.accepts = 0
        self._tasks: set[asyncio.Task] = set()
        self.writers: list[asyncio.StreamWriter] = []  # every connection it accepted

    async def start(self) -> RawServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def url(self, path: str = "/") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepts += 1
        self._tasks.add(asyncio.current_task())
        self.writers.append(writer)
        try:
            await self._handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client hung up: that is its right
        except asyncio.CancelledError:
            pass  # close() ended it; asyncio would log a cancelled handler as an error
        finally:
            writer.close()

    async def close(self) -> None:
        self._server.close()
        for writer in self.writers:
            writer.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()


@pytest.fixture
async def serve():
    """``await serve(handler)``: a started RawServer, closed after the test."""
    servers: list[RawServer] = []

    async def start(handler: Handler) -> RawServer:
        server = await RawServer(handler).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def client():
    client = HttpClient(USER_AGENT, timeouts=Timeouts(connect=2.0, read=2.0))
    yield client
    await client.close()


@pytest.fixture
async def quick_client():
    """One whose silence timeout is short, for the timeout tests."""
    client = HttpClient(USER_AGENT, timeouts=Timeouts(connect=2.0, read=0.3))
    yield client
    await client.close()


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """The next request head, or None when the client closed the connection."""
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


def respond(*answers: bytes, heads: list[bytes] | None = None, close: bool = False) -> Handler:
    """Answers each request on a connection with the next of ``answers`` (the last one
    repeats); records the request heads; with ``close``, hangs up after the first answer."""
    async def handler(reader, writer):
        for index in range(10_000):
            head = await read_request(reader)
            if head is None:
                return
            if heads is not None:
                heads.append(head)
            writer.write(answers[min(index, len(answers) - 1)])
            await writer.drain()
            if close:
                return
    return handler


def ok(body: bytes, *headers: str, status: str = "HTTP/1.1 200 OK") -> bytes:
    """A Content-Length response."""
    lines = [status, f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def head(*lines: str | bytes) -> bytes:
    return b"".join((line.encode("latin-1") if isinstance(line, str) else line) + b"\r\n"
                    for line in lines) + b"\r\n"


def chunked(*chunks: bytes, trailers: bytes = b"") -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks) + b"0\r\n" + trailers + b"\r\n"


CHUNKED_HEAD = head("HTTP/1.1 200 OK", "Transfer-Encoding: chunked")


async def fetch(client: HttpClient, url: str, max_bytes: int = MAX) -> tuple[Response, bytes]:
    """The response and its whole body, its segment released."""
    segments = SegmentPool(max_bytes + 1)
    try:
        async with client.get(url) as response:
            body = await response.read_body(segments, max_bytes)
            try:
                return response, body.bytes()
            finally:
                body.release()
    finally:
        segments.close()


def noise(size: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(size)


# --- 1. Content-Length bodies and the request sent -------------------------------
async def test_content_length_body_lands_in_shared_memory_and_request_is_clean(serve, client):
    data = noise(3 << 20)
    heads: list[bytes] = []
    server = await serve(respond(ok(data, "Content-Type: image/jpeg"), heads=heads))
    segments = SegmentPool(len(data) + 1)
    async with client.get(server.url("/img/a%20b.jpg?size=large&x=1")) as response:
        assert (response.status, response.version) == (200, 1)
        assert response.headers["content-type"] == "image/jpeg"
        body = await response.read_body(segments, len(data))
    try:
        assert body.size == len(data)
        assert body.bytes() == data
        assert re.fullmatch(r"/proc/\d+/fd/\d+", body.path)
        with open(body.path, "rb") as shared:  # what a pool process sees
            assert shared.read(len(data)) == data
    finally:
        body.release()
        segments.close()

    [request] = heads
    lines = request.decode("latin-1").split("\r\n")
    assert lines[0] == "GET /img/a%20b.jpg?size=large&x=1 HTTP/1.1"
    fields = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:] if line)}
    assert fields["host"] == f"127.0.0.1:{server.port}"
    assert fields["user-agent"] == USER_AGENT
    assert fields["accept-encoding"] == "identity"
    assert request.endswith(b"\r\n\r\n") and request.count(b"\r\n\r\n") == 1


async def test_time_to_first_byte_is_the_sites_wait_not_the_body(serve, client):
    """The adaptive back-off reads this: a site that queues requests answers late."""
    async def late_head_then_slow_body(reader, writer):
        for delay in (0.3, 0.0):  # the second request comes on the same connection
            await read_request(reader)
            await asyncio.sleep(delay)
            writer.write(head("HTTP/1.1 200 OK", "Content-Length: 4") + b"ab")
            await writer.drain()
            await asyncio.sleep(0.6)  # the rest of the body takes its time: not the site's wait
            writer.write(b"cd")
            await writer.drain()
    server = await serve(late_head_then_slow_body)
    first, body = await fetch(client, server.url("/1"))
    second, _ = await fetch(client, server.url("/2"))
    assert body == b"abcd" and server.accepts == 1
    assert 0.3 <= first.ttfb < 0.9, first.ttfb
    assert 0 <= second.ttfb < first.ttfb and second.ttfb < 0.6, second.ttfb


# --- 2. keep-alive ---------------------------------------------------------------
async def test_keep_alive_carries_requests_on_one_connection(serve, client):
    server = await serve(respond(ok(b"first"), ok(b"second")))
    assert (await fetch(client, server.url("/1")))[1] == b"first"
    assert (await fetch(client, server.url("/2")))[1] == b"second"
    assert server.accepts == 1


@pytest.mark.parametrize("answer, connections", [
    (ok(b"body", "Connection: close"), 2),
    (ok(b"body", "Connection: keep-alive, Close"), 2),
    (ok(b"body", status="HTTP/1.0 200 OK"), 2),
    (ok(b"body", "Connection: keep-alive", status="HTTP/1.0 200 OK"), 1),
], ids=["close", "close-in-list", "http1.0", "http1.0-keep-alive"])
async def test_connection_header_and_version_decide_reuse(serve, client, answer, connections):
    server = await serve(respond(answer))  # the server itself would carry on either way
    for _ in range(2):
        assert (await fetch(client, server.url()))[1] == b"body"
    assert server.accepts == connections


async def test_idle_connections_are_closed_by_a_timer_without_further_traffic(serve, client, monkeypatch):
    """A crawl that stops must not leave keep-alive sockets open until the next request."""
    from worker.fetching import http_client
    monkeypatch.setattr(http_client, "HTTP_IDLE_SECONDS", 0.2)
    monkeypatch.setattr(http_client, "IDLE_SWEEP_SECONDS", 0.1)
    server = await serve(respond(ok(b"body")))
    assert (await fetch(client, server.url()))[1] == b"body"
    assert client.idle_connections == 1
    await asyncio.sleep(0.6)
    assert client.idle_connections == 0 and all(w.is_closing() or w.transport.is_closing() for w in server.writers)


async def test_a_full_pool_closes_the_connection_idle_longest(serve, client, monkeypatch):
    """Past HTTP_MAX_IDLE_CONNECTIONS the oldest idle connection makes room: a site of one URL
    does not keep a busy site's connection from being kept."""
    from worker.fetching import http_client
    monkeypatch.setattr(http_client, "HTTP_MAX_IDLE_CONNECTIONS", 2)
    first, second, busy = [await serve(respond(ok(b"body"))) for _ in range(3)]
    for server in (first, second, busy):
        assert (await fetch(client, server.url()))[1] == b"body"
    assert client.idle_connections == 2
    for _ in range(3):
        assert (await fetch(client, busy.url()))[1] == b"body"
    assert (await fetch(client, second.url()))[1] == b"body"
    assert (await fetch(client, first.url()))[1] == b"body"
    assert (busy.accepts, second.accepts, first.accepts) == (1, 1, 2)
    assert client.idle_connections == 2


# --- 3. stale connections --------------------------------------------------------
@pytest.mark.parametrize("pause", [0.0, 0.05], ids=["at-once", "after-idle"])
async def test_connection_closed_by_server_while_idle_is_replaced(serve, client, pause):
    server = await serve(respond(ok(b"hello"), close=True))  # keep-alive promised, then hung up
    assert (await fetch(client, server.url()))[1] == b"hello"
    await asyncio.sleep(pause)
    assert (await fetch(client, server.url()))[1] == b"hello"
    assert server.accepts == 2


async def test_reused_connection_closed_on_the_next_request_is_retried_once(serve, client):
    """The race that makes retries necessary: the server's idle timer fires just as our
    request arrives, so it reads the request and hangs up without a byte of answer."""
    connections = 0

    async def handler(reader, writer):
        nonlocal connections
        connections += 1
        answered = 0
        while (await read_request(reader)) is not None:
            if connections == 1 and answered == 1:
                return  # the second request on the first connection: hang up
            writer.write(ok(b"image"))
            answered += 1

    server = await serve(handler)
    assert (await fetch(client, server.url("/a")))[1] == b"image"
    assert (await fetch(client, server.url("/b")))[1] == b"image"
    assert server.accepts == 2


async def test_server_that_hangs_up_on_every_request_gives_disconnected(serve, client):
    server = await serve(respond(b"", close=True))  # reads the request, answers nothing
    with pytest.raises(Disconnected):
        await fetch(client, server.url())
    assert server.accepts == 1  # a fresh connection is not retried


async def test_stale_retry_happens_once_not_forever(serve, client):
    requests = 0

    async def handler(reader, writer):
        nonlocal requests
        while (await read_request(reader)) is not None:
            requests += 1
            if requests > 1:
                return  # every request after the first: hung up on
            writer.write(ok(b"once"))

    server = await serve(handler)
    assert (await fetch(client, server.url()))[1] == b"once"
    with pytest.raises(Disconnected):
        await fetch(client, server.url())
    assert server.accepts == 2  # the reused one, then exactly one fresh one
    assert requests == 3


# --- 4. chunked bodies -----------------------------------------------------------
async def test_chunked_many_small_chunks(serve, client):
    data = noise(40_000, seed=2)
    rng = random.Random(3)
    pieces, at = [], 0
    while at < len(data):
        size = rng.randint(1, 17)
        pieces.append(data[at:at + size])
        at += size
    server = await serve(respond(CHUNKED_HEAD + chunked(*pieces)))
    assert (await fetch(client, server.url()))[1] == data
    assert (await fetch(client, server.url()))[1] == data
    assert server.accepts == 1  # read to its exact end: reusable


async def test_chunked_one_huge_chunk(serve, client):
    data = noise(2 << 20, seed=4)
    server = await serve(respond(CHUNKED_HEAD + chunked(data)))
    assert (await fetch(client, server.url(), max_bytes=len(data)))[1] == data


async def test_chunk_extensions_uppercase_hex_and_trailers(serve, client):
    # no whitespace around the ";": llhttp (strict) refuses it, so we do too
    body = (b"5;name=value\r\nhello\r\n"
            b"00B;ext;quoted=\"a;b\"\r\n world, 123\r\n"
            b"0;last\r\nX-Checksum: abc\r\nX-Other: 1\r\n\r\n")
    server = await serve(respond(CHUNKED_HEAD + body))
    response, data = await fetch(client, server.url())
    assert data == b"hello world, 123"
    assert "X-Checksum" not in response.headers
    await fetch(client, server.url())
    assert server.accepts == 1  # the trailers were consumed to the final CRLF


@pytest.mark.parametrize("after", [b"GARBAGE", ok(b"unasked")], ids=["garbage", "a-second-response"])
async def test_bytes_after_a_chunked_body_leave_it_whole_but_the_connection_unused(serve, client, after):
    server = await serve(respond(CHUNKED_HEAD + chunked(b"hello") + after))
    assert (await fetch(client, server.url()))[1] == b"hello"
    assert (await fetch(client, server.url()))[1] == b"hello"
    assert server.accepts == 2  # what followed was nobody's answer: never read as the next one


async def test_too_many_trailers_is_bad_response(serve, client):
    trailers = b"".join(b"X-T%d: v\r\n" % i for i in range(129))
    server = await serve(respond(CHUNKED_HEAD + chunked(b"hello", trailers=trailers)))
    with pytest.raises(BadResponse):
        await fetch(client, server.url())


@pytest.mark.parametrize("body", [
    b"zz\r\nhello\r\n0\r\n\r\n",
    b"-5\r\nhello\r\n0\r\n\r\n",
    b"0x5\r\nhello\r\n0\r\n\r\n",
    b"+5\r\nhello\r\n0\r\n\r\n",
    b"\r\nhello\r\n0\r\n\r\n",
    b"5 5\r\nhello\r\n0\r\n\r\n",
    b"1234567890abcdef0\r\nhello\r\n0\r\n\r\n",
], ids=["not-hex", "negative", "0x", "plus", "empty", "two-numbers", "too-many-digits"])
async def test_malformed_chunk_size_is_bad_response(serve, client, body):
    server = await serve(respond(CHUNKED_HEAD + body))
    with pytest.raises(BadResponse):
        await fetch(client, server.url())


@pytest.mark.parametrize("body", [
    b"5\r\nhelloXX\r\n0\r\n\r\n",   # chunk longer than it said
    b"5\r\nhello0\r\n\r\n",         # no CRLF at all
    b"5\r\nhelloX\n0\r\n\r\n",      # something else before the LF
], ids=["longer", "no-crlf", "junk-lf"])
async def test_chunk_data_not_followed_by_crlf_is_bad_response(serve, client, body):
    server = await serve(respond(CHUNKED_HEAD + body))
    with pytest.raises(BadResponse):
        await fetch(client, server.url())


@pytest.mark.parametrize("body", [
    b"400\r\n" + b"x" * 100,   # in the middle of a chunk's data
    b"5\r\nhello\r\n",         # between chunks
    b"5\r\nhello\r\n0\r\n",    # before the final CRLF
], ids=["mid-chunk", "between-chunks", "before-end"])
async def test_connection_cut_inside_a_chunked_body_is_disconnected(serve, client, body):
    server = await serve(respond(CHUNKED_HEAD + body, close=True))
    with pytest.raises(Disconnected):
        await fetch(client, server.url())


# --- 5. read-until-close bodies --------------------------------------------------
async def test_body_until_close_is_read_fully_and_connection_not_reused(serve, client):
    data = noise(300_000, seed=5)
    server = await serve(respond(head("HTTP/1.1 200 OK", "Content-Type: image/png") + data, close=True))
    assert (await fetch(client, server.url(), max_bytes=len(data)))[1] == data
    assert (await fetch(client, server.url(), max_bytes=len(data)))[1] == data
    assert server.accepts == 2


async def test_body_until_reset_is_not_a_complete_body(serve, client):
    """Only a clean close ends a read-until-close body: a reset connection lost the rest."""
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(head("HTTP/1.1 200 OK") + b"x" * 1000)
        await writer.drain()
        await asyncio.sleep(0.1)  # the client has the 1000 bytes
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST, not FIN

    server = await serve(handler)
    with pytest.raises(Disconnected):
        await fetch(client, server.url())


# --- 6. the size cap -------------------------------------------------------------
async def test_declared_length_over_the_cap_fails_before_reading(serve, client):
    # the head only: a client that started reading would wait for a body that never comes
    server = await serve(respond(head("HTTP/1.1 200 OK", f"Content-Length: {MAX + 1}")))
    started = time.monotonic()
    with pytest.raises(BodyTooLarge):
        await fetch(client, server.url())
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("answer, close", [
    (CHUNKED_HEAD + chunked(*[b"c" * 1000] * (MAX // 1000 + 2)), False),
    (CHUNKED_HEAD + chunked(b"c" * (MAX + 1)), False),
    # llhttp does not tell a chunk's size: the cap stops the bytes as they arrive
    (CHUNKED_HEAD + b"FFFFFFFFFFFFFFF\r\n" + b"c" * (MAX + 1), False),
    (head("HTTP/1.1 200 OK") + b"u" * (MAX + 1), True),
    (head("HTTP/1.1 200 OK") + b"u" * (4 * MAX), True),
], ids=["chunks-grow", "one-chunk", "huge-chunk-size", "until-close-one-over", "until-close-far-over"])
async def test_body_growing_past_the_cap_is_too_large(serve, client, answer, close):
    server = await serve(respond(answer, close=close))
    started = time.monotonic()
    with pytest.raises(BodyTooLarge):
        await fetch(client, server.url())
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("framing", ["content-length", "chunked", "until-close"])
async def test_body_of_exactly_the_cap_is_fine(serve, client, framing):
    data = noise(MAX, seed=6)
    answer = {"content-length": ok(data),
              "chunked": CHUNKED_HEAD + chunked(data[:1000], data[1000:]),
              "until-close": head("HTTP/1.1 200 OK") + data}[framing]
    server = await serve(respond(answer, close=framing == "until-close"))
    assert (await fetch(client, server.url(), max_bytes=MAX))[1] == data


# --- 7. hostile heads ------------------------------------------------------------
@pytest.mark.parametrize("answer", [
    b"garbage\r\n\r\n",
    b"HTTP/2 200\r\n\r\n",
    b"HTTP/1.1 20 OK\r\n\r\n",
    b"ICY 200 OK\r\n\r\n",
    b" HTTP/1.1 200 OK\r\n\r\n",
    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",
    head("HTTP/1.1 200 OK", *[f"X-H{i}: v" for i in range(129)]),
    head("HTTP/1.1 200 OK", "Content-Length: 2", "no colon here") + b"ok",
    head("HTTP/1.1 200 OK", "Content-Length : 2") + b"ok",
    head("HTTP/1.1 200 OK", "Content-Length: 2", " folded continuation") + b"ok",
    head("HTTP/1.1 200 OK", ": empty name", "Content-Length: 2") + b"ok",
], ids=["garbage", "http2", "two-digit-status", "icy", "leading-space", "101", "129-headers",
        "no-colon", "space-before-colon", "obs-fold", "empty-name"])
async def test_bad_heads_are_bad_response(serve, client, answer):
    server = await serve(respond(answer))  # then stays open: the verdict must not wait for it
    with pytest.raises(BadResponse):
        await fetch(client, server.url())


async def test_128_header_lines_are_accepted(serve, client):
    server = await serve(respond(ok(b"ok", *[f"X-H{i}: v" for i in range(127)])))  # + Content-Length
    response, data = await fetch(client, server.url())
    assert data == b"ok" and len(response.headers) == 128


@pytest.mark.parametrize("lengths", [
    ["5, 6"], ["5", "6"], ["-5"], ["five"], [""], ["1234567890123456"], ["0x5"], ["5 5"], ["\xb2"],
], ids=["list", "two-headers", "negative", "word", "empty", "16-digits", "hex", "space", "superscript-two"])
async def test_untrustworthy_content_length_is_bad_response(serve, client, lengths):
    answer = head("HTTP/1.1 200 OK", *[f"Content-Length: {value}" for value in lengths]) + b"hello"
    server = await serve(respond(answer))
    with pytest.raises(BadResponse):
        await fetch(client, server.url())


@pytest.mark.parametrize("lengths", [["5, 5"], ["5", "5"], [" 5 ", "5,5"]], ids=["list", "two", "spaces"])
async def test_repeated_identical_content_length_is_bad_response(serve, client, lengths):
    # RFC 9110 lets a recipient take them; llhttp refuses them, and so do we
    server = await serve(respond(head("HTTP/1.1 200 OK", *[f"Content-Length: {v}" for v in lengths]) + b"hello"))
    with pytest.raises(BadResponse):
        await fetch(client, server.url())


@pytest.mark.parametrize("codings", [["gzip"], ["gzip, chunked"], ["chunked, chunked"], ["chunked", "gzip"],
                                     ["identity"]])
async def test_transfer_codings_other_than_chunked_are_bad_response(serve, client, codings):
    answer = head("HTTP/1.1 200 OK", *[f"Transfer-Encoding: {value}" for value in codings]) + chunked(b"hello")
    server = await serve(respond(answer))
    with pytest.raises(BadResponse):
        await fetch(client, server.url())


async def test_content_length_with_chunked_is_bad_response(serve, client):
    # framing that two parsers could read two ways: llhttp refuses it, and so do we
    answer = head("HTTP/1.1 200 OK", "Content-Length: 3", "Transfer-Encoding: chunked") + chunked(b"hello", b"!")
    server = await serve(respond(answer))
    with pytest.raises(BadResponse):
        await fetch(client, server.url())


async def test_head_that_never_ends_is_bad_response_in_bounded_memory(serve, client):
    sent = 0

    async def handler(reader, writer):
        nonlocal sent
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Endless: ")
        piece = b"a" * (64 << 10)
        while sent < 32 << 20:
            writer.write(piece)
            await writer.drain()
            sent += len(piece)

    server = await serve(handler)
    tracemalloc.start()
    try:
        with pytest.raises(BadResponse):
            await fetch(client, server.url())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # what it sent and could have sent was far more
    assert sent < 32 << 20


async def test_bytes_after_a_kept_response_are_not_buffered_without_bound(serve, client):
    """A server that answers, then floods the idle keep-alive connection: nobody reads it,
    so the client must stop reading instead of holding all of it, and never reuse it."""
    flooded = asyncio.Event()
    sent = 0

    async def handler(reader, writer):
        nonlocal sent
        await read_request(reader)
        writer.write(ok(b"fine"))
        await asyncio.sleep(0.1)  # the client has put the connection aside by now
        piece = b"z" * (64 << 10)
        try:
            async with asyncio.timeout(0.5):
                for _ in range(512):  # 32 MiB, if the client took it all
                    writer.write(piece)
                    await writer.drain()
                    sent += len(piece)
        except TimeoutError:
            pass  # the client stopped reading: the kernel buffers are full
        finally:
            flooded.set()
        await read_request(reader)

    server = await serve(handler)
    tracemalloc.start()
    try:
        assert (await fetch(client, server.url()))[1] == b"fine"
        await asyncio.wait_for(flooded.wait(), 5)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert 1 << 20 <= sent < 32 << 20, sent  # flooded, until the client stopped reading
    assert peak < 2 << 20, peak
    assert (await fetch(client, server.url()))[1] == b"fine"
    assert server.accepts == 2


# --- 8. interim responses --------------------------------------------------------
async def test_interim_1xx_responses_are_skipped(serve, client):
    answer = (b"HTTP/1.1 100 Continue\r\n\r\n"
              + head("HTTP/1.1 103 Early Hints", "Link: </style.css>; rel=preload")
              + ok(b"final", "X-Final: yes"))
    server = await serve(respond(answer))
    response, data = await fetch(client, server.url())
    assert (response.status, data) == (200, b"final")
    assert response.headers["X-Final"] == "yes" and "Link" not in response.headers
    await fetch(client, server.url())
    assert server.accepts == 1


# --- 9. short bodies -------------------------------------------------------------
async def test_body_shorter_than_content_length_is_disconnected(serve, client):
    server = await serve(respond(head("HTTP/1.1 200 OK", "Content-Length: 5000") + b"x" * 4000, close=True))
    with pytest.raises(Disconnected):
        await fetch(client, server.url())


# --- 10. timeouts ----------------------------------------------------------------
async def test_silent_server_times_out_after_the_read_timeout(serve, quick_client):
    server = await serve(lambda reader, writer: asyncio.sleep(30))
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await fetch(quick_client, server.url())
    assert 0.25 <= time.monotonic() - started < 2.0


async def test_server_silent_after_the_head_times_out(serve, quick_client):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(head("HTTP/1.1 200 OK", "Content-Length: 100") + b"x" * 10)
        await asyncio.sleep(30)

    server = await serve(handler)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await fetch(quick_client, server.url())
    assert 0.25 <= time.monotonic() - started < 2.0


async def test_trickling_server_is_silence_not_total_timeout(serve, quick_client):
    """Every part trickles a byte each 0.1 s, well past the 0.3 s silence timeout in total."""
    answer = head("HTTP/1.1 200 OK", "Transfer-Encoding: chunked") + chunked(b"abc", b"de")

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(answer[:30])
        for index in range(30, len(answer), 4):
            await asyncio.sleep(0.1)
            writer.write(answer[index:index + 4])
        await read_request(reader)

    server = await serve(handler)
    started = time.monotonic()
    assert (await fetch(quick_client, server.url()))[1] == b"abcde"
    assert time.monotonic() - started > 0.5


async def test_trickling_content_length_body(serve, quick_client):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(head("HTTP/1.1 200 OK", "Content-Length: 6"))
        for byte in b"abcdef":
            await asyncio.sleep(0.1)
            writer.write(bytes([byte]))
        await read_request(reader)

    server = await serve(handler)
    assert (await fetch(quick_client, server.url()))[1] == b"abcdef"


async def test_nobody_listening_is_connect_failed(client):
    with socket.socket() as reserved:  # bound, never listening: the port refuses
        reserved.bind(("127.0.0.1", 0))
        port = reserved.getsockname()[1]
        with pytest.raises(ConnectFailed):
            await fetch(client, f"http://127.0.0.1:{port}/")


# --- 11. Content-Encoding the server applied unasked -----------------------------------
@pytest.mark.parametrize("encoding, encode", [
    ("gzip", gzip.compress), ("x-gzip", gzip.compress), ("deflate", zlib.compress)])
async def test_compressed_body_is_decoded(serve, client, encoding, encode):
    data = noise(20_000, seed=7) + b"\0" * 30_000
    server = await serve(respond(ok(encode(data), f"Content-Encoding: {encoding}")))
    assert (await fetch(client, server.url()))[1] == data


async def test_gzip_bomb_is_too_large(serve, client):
    bomb = gzip.compress(b"\0" * (8 << 20))
    assert len(bomb) < MAX
    server = await serve(respond(ok(bomb, "Content-Encoding: gzip")))
    with pytest.raises(BodyTooLarge):
        await fetch(client, server.url())


def _bad_crc(data: bytes) -> bytes:
    packed = gzip.compress(data)
    return packed[:-8] + bytes([packed[-8] ^ 0xFF]) + packed[-7:]


@pytest.mark.parametrize("body", [
    b"this is not gzip at all",
    _bad_crc(b"an image" * 100),
    gzip.compress(noise(10_000, seed=8))[:5000],
], ids=["garbage", "bad-crc", "truncated"])
async def test_corrupt_gzip_is_bad_response(serve, client, body):
    server = await serve(respond(ok(body, "Content-Encoding: gzip")))
    with pytest.raises(BadResponse):
        await fetch(client, server.url())


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_every_gzip_member_is_decoded(serve, client, framing):
    first, second = noise(5000, seed=9), noise(7000, seed=10)
    packed = gzip.compress(first) + gzip.compress(second)  # what `cat a.gz b.gz` gives
    answer = (ok(packed, "Content-Encoding: gzip") if framing == "content-length" else
              head("HTTP/1.1 200 OK", "Transfer-Encoding: chunked", "Content-Encoding: gzip")
              + chunked(packed[:3000], packed[3000:]))
    server = await serve(respond(answer))
    assert (await fetch(client, server.url()))[1] == first + second


@pytest.mark.parametrize("encoding, body", [
    ("gzip", gzip.compress(b"an image" * 100) + b"trailing garbage"),
    ("gzip", gzip.compress(b"an image" * 100) + b"\x1f"),
    ("gzip", gzip.compress(b"an image" * 100) + gzip.compress(b"cut")[:-3]),
    ("deflate", zlib.compress(b"an image" * 100) + b"x"),
    ("deflate", zlib.compress(b"an image" * 100)[2:-4] + b"xyz"),  # raw deflate, then bytes
], ids=["gzip-garbage", "gzip-one-byte", "gzip-cut-second-member", "zlib-garbage", "raw-garbage"])
async def test_bytes_after_the_compressed_stream_are_bad_response(serve, client, encoding, body):
    server = await serve(respond(ok(body, f"Content-Encoding: {encoding}")))
    with pytest.raises(BadResponse):
        await fetch(client, server.url())


async def test_gzip_bomb_in_many_members_is_too_large(serve, client):
    member = gzip.compress(b"\0" * (MAX // 4))
    server = await serve(respond(ok(member * 8, "Content-Encoding: gzip")))
    with pytest.raises(BodyTooLarge):
        await fetch(client, server.url())


# --- 12. URLs that must not become requests ---------------------------------------
@pytest.mark.parametrize("url", ["ftp://127.0.0.1/a.jpg", "file:///etc/passwd", "http:///a.jpg",
                                 "http://a b.example/", "data:image/png;base64,AAAA"])
async def test_unusable_urls_are_value_errors(client, url):
    with pytest.raises(ValueError):
        await fetch(client, url)


@pytest.mark.parametrize("path", ["/a\r\nX-Evil: 1", "/a?q=1\r\nX-Evil: 1", "/a\nX-Evil:1", "/a\rX-Evil: 1",
                                  "/a b\r\n\r\nGET /smuggled HTTP/1.1"])
async def test_crlf_in_url_cannot_inject_header_lines(serve, client, path):
    heads: list[bytes] = []
    server = await serve(respond(ok(b"ok"), heads=heads))
    try:
        await fetch(client, server.url(path))
    except ValueError:
        pass  # refusing is as good as quoting
    for request in heads:
        lines = request.split(b"\r\n")
        assert not any(line.lower().startswith(b"x-evil") for line in lines), request
        assert lines[0].startswith(b"GET /a") and lines[0].endswith(b" HTTP/1.1") and lines[0].count(b" ") == 2
        assert b"\r" not in request.replace(b"\r\n", b"") and b"\n" not in request.replace(b"\r\n", b"")
    assert len(heads) <= 1  # one URL, at most one request


# --- 13. responses whose body nobody reads ----------------------------------------
async def test_unread_redirect_closes_the_connection(serve, client):
    closed = asyncio.Event()

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(head("HTTP/1.1 302 Found", "Location: /elsewhere.jpg", f"Content-Length: {8 << 20}")
                     + b"r" * 1000)  # the rest of a big body never comes
        if await read_request(reader) is None:
            closed.set()

    server = await serve(handler)
    started = time.monotonic()
    async with client.get(server.url("/moved.jpg")) as response:
        assert response.status == 302 and response.headers["Location"] == "/elsewhere.jpg"
    await asyncio.wait_for(closed.wait(), 2)
    assert time.monotonic() - started < 1.0

    server2 = await serve(respond(ok(b"x")))
    async with client.get(server2.url()) as response:
        assert response.status == 200  # unread again
    await fetch(client, server2.url())
    assert server2.accepts == 2  # an unread body leaves the connection unusable


@pytest.mark.parametrize("status", ["204 No Content", "304 Not Modified"])
async def test_bodiless_statuses_are_complete_and_reusable(serve, client, status):
    # a 304 may carry the length its 200 would have had: it has no body all the same
    server = await serve(respond(head(f"HTTP/1.1 {status}", "Content-Length: 1234"), ok(b"ok")))
    response, data = await fetch(client, server.url())
    assert (response.status, data) == (int(status[:3]), b"")
    assert (await fetch(client, server.url()))[1] == b"ok"
    assert server.accepts == 1


# --- 14. the injected resolver ---------------------------------------------------
class FakeResolver:
    def __init__(self, addresses: list[str] | None = None, refuse: bool = False, hang: bool = False):
        self.addresses = addresses or ["127.0.0.1"]
        self.refuse, self.hang = refuse, hang
        self.calls: list[tuple] = []
        self.closed = False

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[dict]:
        self.calls.append((host, port, family))
        if self.hang:
            await asyncio.sleep(30)
        if self.refuse:
            raise Refused("ForbiddenAddress", f"{host} resolves to a private address")
        return [{"host": address, "port": port, "family": socket.AF_INET, "hostname": host,
                 "proto": 0, "flags": 0} for address in self.addresses]

    async def close(self) -> None:
        self.closed = True


async def test_resolver_decides_where_a_name_connects(serve):
    heads: list[bytes] = []
    server = await serve(respond(ok(b"resolved"), heads=heads))
    resolver = FakeResolver()
    client = HttpClient(USER_AGENT, resolver=resolver, timeouts=Timeouts(connect=2.0, read=2.0))
    try:
        assert (await fetch(client, f"http://some.test:{server.port}/a.jpg"))[1] == b"resolved"
    finally:
        await client.close()
    assert [call[:2] for call in resolver.calls] == [("some.test", server.port)]
    assert f"\r\nHost: some.test:{server.port}\r\n".encode() in heads[0]
    assert resolver.closed


async def test_dead_address_falls_through_to_the_next(serve):
    server = await serve(respond(ok(b"second address")))  # listens on 127.0.0.1 only
    client = HttpClient(USER_AGENT, resolver=FakeResolver(["127.0.0.2", "127.0.0.1"]),
                        timeouts=Timeouts(connect=2.0, read=2.0))
    try:
        assert (await fetch(client, f"http://some.test:{server.port}/"))[1] == b"second address"
    finally:
        await client.close()


async def test_resolver_refusal_propagates(serve):
    server = await serve(respond(ok(b"never")))
    client = HttpClient(USER_AGENT, resolver=FakeResolver(refuse=True))
    try:
        with pytest.raises(Refused) as refused:
            await fetch(client, f"http://internal.test:{server.port}/")
    finally:
        await client.close()
    assert refused.value.reason == "ForbiddenAddress"
    assert server.accepts == 0


async def test_hanging_resolver_is_bounded_by_the_connect_timeout():
    client = HttpClient(USER_AGENT, resolver=FakeResolver(hang=True), timeouts=Timeouts(connect=0.3, read=5.0))
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            await fetch(client, "http://slow-dns.test/")
    finally:
        await client.close()
    assert time.monotonic() - started < 2.0


async def test_tls_to_a_plain_http_server_is_ssl_error(serve, client):
    async def handler(reader, writer):  # answers the ClientHello as a plain HTTP server would
        await reader.read(1)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    server = await serve(handler)
    with pytest.raises(ssl.SSLError):
        await fetch(client, f"https://127.0.0.1:{server.port}/")


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1, made by the openssl command (no Python package
    for it is a dependency). Without openssl the TLS tests fail: they never skip."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", key, "-out", cert], check=True, capture_output=True)
    return cert, key


async def test_tls_bodies_land_in_shared_memory_on_a_kept_connection(serve, certificate):
    """asyncio's TLS transport feeds a buffered protocol too: same bytes, same reuse."""
    cert, key = certificate
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)
    body = noise(3 << 20)
    accepted = 0

    async def handler(reader, writer):
        nonlocal accepted
        accepted += 1
        await respond(ok(body))(reader, writer)
    server = await asyncio.start_server(handler, "127.0.0.1", 0, ssl=server_context)
    port = server.sockets[0].getsockname()[1]
    trusting = HttpClient(USER_AGENT, ssl_context=ssl.create_default_context(cafile=cert))
    try:
        for _ in range(2):
            _response, received = await fetch(trusting, f"https://127.0.0.1:{port}/a.jpg", 4 << 20)
            assert received == body
        assert accepted == 1
        answer = CHUNKED_HEAD + chunked(*[body[i:i + 65536] for i in range(0, len(body), 65536)])
        chunked_server = await asyncio.start_server(respond(answer), "127.0.0.1", 0, ssl=server_context)
        chunked_url = f"https://127.0.0.1:{chunked_server.sockets[0].getsockname()[1]}/a.jpg"
        for _ in range(2):  # and chunked bodies, through the shared stream buffer
            assert (await fetch(trusting, chunked_url, 4 << 20))[1] == body
        chunked_server.close()
        with pytest.raises(ssl.SSLCertVerificationError):  # the system's roots do not trust it
            await fetch(HttpClient(USER_AGENT), f"https://127.0.0.1:{port}/a.jpg", 4 << 20)
    finally:
        await trusting.close()
        server.close()


def _tls_server(certificate: tuple[str, str], answer: bytes, close_notify: bool) -> socket.socket:
    """A listening socket whose one connection gets ``answer`` over TLS, then the end of the
    stream: with close_notify (``unwrap``), or as a bare TCP FIN, as a cut would look."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*certificate)
    listener = socket.create_server(("127.0.0.1", 0))

    def serve_one() -> None:
        connection, _ = listener.accept()
        with context.wrap_socket(connection, server_side=True) as tls:
            tls.recv(65536)
            tls.sendall(answer)
            if close_notify:
                tls.unwrap().close()
            else:
                tls.shutdown(socket.SHUT_RDWR)  # SSLSocket.shutdown: TCP only, no close_notify

    threading.Thread(target=serve_one, daemon=True).start()
    return listener


@pytest.mark.parametrize("close_notify", [True, False], ids=["close-notify", "bare-fin"])
async def test_tls_body_until_close_needs_close_notify(certificate, close_notify):
    data = noise(200_000, seed=11)
    listener = _tls_server(certificate, head("HTTP/1.1 200 OK") + data, close_notify)
    trusting = HttpClient(USER_AGENT, timeouts=Timeouts(connect=2.0, read=2.0),
                          ssl_context=ssl.create_default_context(cafile=certificate[0]))
    url = f"https://127.0.0.1:{listener.getsockname()[1]}/a.jpg"
    try:
        if close_notify:
            assert (await fetch(trusting, url, 1 << 20))[1] == data
        else:
            with pytest.raises(Disconnected):  # retried, never stored as a whole image
                await fetch(trusting, url, 1 << 20)
    finally:
        await trusting.close()
        listener.close()


# --- 15. segments go back to the pool ---------------------------------------------
async def test_released_bodies_give_their_segment_back(serve, client):
    server = await serve(respond(ok(b"a" * 5000), CHUNKED_HEAD + chunked(*[b"b" * 1000] * 100)))
    segments = SegmentPool(MAX + 1)
    try:
        async with client.get(server.url()) as response:
            body = await response.read_body(segments, MAX)
        segment = body.segment
        body.release()
        body.release()  # twice is harmless
        assert segments.take() is segment
        segments.give_back(segment)

        async with client.get(server.url()) as response:
            with pytest.raises(BodyTooLarge):  # a failed read gives its segment back too
                await response.read_body(segments, MAX)
        assert segments.take() is segment
    finally:
        segments.close()


# --- 16. PUTs (the thumbnail store's requests) -------------------------------------
def take_puts(*answers: bytes, requests: list[tuple[bytes, bytes]], close: bool = False) -> Handler:
    """Reads each PUT's head and body, answers with the next of ``answers`` (the last repeats)."""
    async def handler(reader, writer):
        for index in range(10_000):
            request_head = await read_request(reader)
            if request_head is None:
                return
            length = re.search(rb"\r\nContent-Length: (\d+)\r\n", request_head)
            assert length is not None, request_head
            requests.append((request_head, await reader.readexactly(int(length.group(1)))))
            writer.write(answers[min(index, len(answers) - 1)])
            await writer.drain()
            if close:
                return
    return handler


async def test_a_put_sends_its_url_as_given_and_its_body_on_a_kept_connection(serve, client):
    requests: list[tuple[bytes, bytes]] = []
    server = await serve(take_puts(ok(b""), requests=requests))
    signed = "/thumbs/..%2F..%2Fother/a.jpg?X-Amz-Credential=AK%2F20261127&X-Amz-Signature=ab12"
    data = noise(31_000, seed=9)
    for _ in range(2):
        assert await client.put(server.url(signed), data, "image/jpeg", MAX) == (200, b"")
    assert server.accepts == 1
    request_head, body = requests[1]
    assert request_head.split(b"\r\n")[0] == f"PUT {signed} HTTP/1.1".encode()  # not re-quoted, no dots resolved
    assert b"\r\nContent-Type: image/jpeg\r\n" in request_head
    assert f"\r\nHost: 127.0.0.1:{server.port}\r\n".encode() in request_head
    assert body == data


@pytest.mark.parametrize("answer, connections", [
    (ok(b"<Error><Code>SlowDown</Code></Error>", status="HTTP/1.1 503 Slow Down"), 1),
    (head("HTTP/1.1 503 Slow Down", "Transfer-Encoding: chunked")
     + chunked(b"<Error><Code>Slow", b"Down</Code></Error>"), 1),
    (head("HTTP/1.1 503 Slow Down", "Connection: close") + b"<Error><Code>SlowDown</Code></Error>", 2),
], ids=["content-length", "chunked", "until-close"])
async def test_a_put_answer_is_read_whole_however_it_is_framed(serve, client, answer, connections):
    requests: list[tuple[bytes, bytes]] = []
    server = await serve(take_puts(answer, requests=requests, close=connections == 2))
    for _ in range(2):
        assert await client.put(server.url("/b/k.jpg"), b"jpeg", "image/jpeg", MAX) == (
            503, b"<Error><Code>SlowDown</Code></Error>")
    assert server.accepts == connections and [body for _head, body in requests] == [b"jpeg", b"jpeg"]


@pytest.mark.parametrize("answer, close", [
    (ok(b"e" * (MAX + 1), status="HTTP/1.1 500 Internal Server Error"), False),
    (head("HTTP/1.1 500 Internal Server Error", "Transfer-Encoding: chunked") + chunked(*[b"e" * 1000] * 70), False),
    (head("HTTP/1.1 500 Internal Server Error") + b"e" * (2 * MAX), True),
], ids=["content-length", "chunked", "until-close"])
async def test_a_put_answer_past_the_cap_is_too_large(serve, client, answer, close):
    server = await serve(take_puts(answer, requests=[], close=close))
    with pytest.raises(BodyTooLarge):
        await client.put(server.url("/b/k.jpg"), b"jpeg", "image/jpeg", MAX)


async def test_a_put_on_a_connection_the_store_closed_while_idle_is_sent_again_whole(serve, client):
    requests: list[tuple[bytes, bytes]] = []
    server = await serve(take_puts(ok(b""), requests=requests, close=True))  # no "Connection: close"
    data = noise(5000, seed=10)
    for _ in range(2):
        assert await client.put(server.url("/b/k.jpg"), data, "image/jpeg", MAX) == (200, b"")
        await asyncio.sleep(0.05)  # the store's close reaches the client while it is idle
    assert server.accepts == 2 and [body for _head, body in requests] == [data, data]


# --- 13. A rules file's prefix (robots.txt, tdmrep.json) ---------------------------------
async def prefix(client: HttpClient, url: str, limit: int) -> bytes:
    async with client.get(url) as response:
        return await response.read_prefix(limit)


@pytest.mark.parametrize("answer", [ok(b"0123456789" * 10), CHUNKED_HEAD + chunked(b"0123456789" * 10),
                                    CHUNKED_HEAD + chunked(*[b"0123456789"] * 10)])
async def test_a_body_within_the_limit_is_read_whole_and_keeps_its_connection(serve, client, answer):
    server = await serve(respond(answer))
    assert await prefix(client, server.url(), 100) == b"0123456789" * 10
    assert await prefix(client, server.url(), 100) == b"0123456789" * 10
    assert server.accepts == 1


@pytest.mark.parametrize("answer, close", [
    (ok(b"0123456789" * 100), False),
    (CHUNKED_HEAD + chunked(*[b"0123456789"] * 100), False),
    (CHUNKED_HEAD + chunked(b"0123456789" * 100), False),
    (head("HTTP/1.1 200 OK") + b"0123456789" * 100, True)])
async def test_a_longer_body_is_cut_at_the_limit_and_its_connection_closed(serve, client, answer, close):
    server = await serve(respond(answer, close=close))
    assert await prefix(client, server.url(), 95) == (b"0123456789" * 10)[:95]
    assert client.idle_connections == 0


@pytest.mark.parametrize("encoding, encode", [
    ("gzip", gzip.compress), ("deflate", zlib.compress), ("deflate", lambda d: zlib.compress(d, wbits=-15))])
async def test_an_encoded_prefix_is_decoded_as_far_as_the_limit(serve, client, encoding, encode):
    text = b"User-agent: *\nDisallow: /private\n" * 1000
    server = await serve(respond(ok(encode(text), f"Content-Encoding: {encoding}")))
    assert await prefix(client, server.url(), 1 << 20) == text
    assert await prefix(client, server.url(), 100) == text[:100]


async def test_a_garbled_encoded_prefix_is_bad_response(serve, client):
    server = await serve(respond(ok(b"not gzip at all", "Content-Encoding: gzip")))
    with pytest.raises(BadResponse):
        await prefix(client, server.url(), 100)
