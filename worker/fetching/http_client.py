"""The HTTP/1.1 client that downloads images: bodies land in shared memory.

Image GETs go through it. It exists for one reason:
aiohttp's parser copies every body once more, and the body then had to be
copied again into memory the pool processes can read. On 12 MP photos those
two passes over a cache-cold 3.5 MB were about half of the worker's CPU per
image. Here the socket is read (``asyncio.BufferedProtocol``) straight into a
``shared_memory.Segment``. The thumbnail store's PUTs go through it too, for less
CPU than aiohttp's request machinery (docs/decisions.md, "Our own HTTP client into
shared memory"), and so do robots.txt and tdmrep.json, so that a site's rules and its first
image share one connection (one TLS handshake a site, not two).

The framing is judged by llhttp (``httptools``, Node.js's parser, with none of
its leniencies on), not by hand-written rules: two parsers that disagree about
where a response ends are how bodies get truncated or smuggled. llhttp reads
every head (exactly the bytes up to the first empty line) and every chunked
body, whose pieces it hands over to be copied once into the segment. A body
framed by a byte count (``Content-Length``, or until the server closes) has
nothing left to judge once llhttp has read its head, so it is received
straight into the segment and never shown to the parser.

Around llhttp, our own policy: heads bounded in size and count, at most
``HTTP_MAX_INTERIM_RESPONSES`` 1xx answers, a size cap checked as bytes
arrive, ``chunked`` as the only transfer coding, the three timeouts (connect,
silence, and the caller's total), and a connection reused only after a
response read to its exact end. Over TLS a body read until the close counts
only if the server ended it with close_notify: a bare TCP FIN may be a
truncation. It also does keep-alive per origin (a stale connection is
retried once on a fresh one), TLS with the system's certificates and address
resolution through an injected resolver (the SSRF guard's), each host's answer kept
10 s (``address_cache``). It asks for
``identity`` encoding and takes gzip or deflate from servers that send them
anyway, every gzip member of them and nothing after the compressed stream.
"""
from __future__ import annotations

import asyncio
import math
import re
import socket
import ssl
import threading
import time
import zlib
from collections import OrderedDict, defaultdict, deque
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import NamedTuple, Protocol
from collections.abc import AsyncIterator, Callable

import httptools
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from common.hosts import Origin, url_origin
from worker.constants import (CONNECT_TIMEOUT, HTTP_IDLE_SECONDS, HTTP_MAX_HEAD_BYTES, IDLE_SWEEP_SECONDS,
                              HTTP_MAX_HEADERS, HTTP_MAX_IDLE_CONNECTIONS,
                              HTTP_MAX_INTERIM_RESPONSES, HTTP_MAX_LENGTH_DIGITS, HTTP_SCRATCH_BYTES,
                              HTTP_STREAM_BUFFER_BYTES, READ_TIMEOUT)
from worker.politeness.addresses import system_resolve
from worker.fetching.address_cache import AddressCache
from worker.fetching.shared_memory import Body, SegmentPool


class BadResponse(Exception):
    """The server's answer breaks HTTP/1.1 in a way that makes its framing untrustworthy."""


class TooLate(Exception):
    """The request's token expired before it could be written (``Ready.send_by``): nothing was sent."""

    def __init__(self, late_by: float):
        super().__init__(f"{late_by * 1000:.1f} ms past its token's deadline")
        self.late_by = late_by


class Disconnected(Exception):
    """The connection ended before the response did."""


class ConnectFailed(OSError):
    """No address of the host accepted a connection."""


class BodyTooLarge(Exception):
    """The body is, or says it is, larger than the cap."""


@dataclass(frozen=True)
class Timeouts:
    connect: float = CONNECT_TIMEOUT
    read: float = READ_TIMEOUT  # silence on an open connection


_UNSAFE = re.compile(r"[\x00-\x20\x7f]")
_GZIP = 16 + zlib.MAX_WBITS
_DECODERS = {"gzip": _GZIP, "x-gzip": _GZIP, "deflate": zlib.MAX_WBITS}
_NO_BODY_STATUSES = frozenset({204, 304})
_VERSIONS = {"1.0": 0, "1.1": 1}


class _Surplus(Exception):
    """Bytes after the end of the final response: not ours to parse."""


class _Exchange:
    """llhttp's reading of the answers to one request: 1xx ones, then the final one.

    One parser per request: llhttp's state after a body we did not feed it (a byte count
    received straight into memory) is of no use for the next response."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._parser.set_dangerous_leniencies(  # the defaults, said out loud: none of them
            lenient_headers=False, lenient_chunked_length=False, lenient_keep_alive=False,
            lenient_transfer_encoding=False, lenient_version=False, lenient_data_after_close=False,
            lenient_optional_lf_after_cr=False, lenient_optional_cr_before_lf=False,
            lenient_optional_crlf_after_chunk=False, lenient_spaces_after_chunk_size=False)
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.status = 0
        self.version = 1          # the minor version
        self.keep_alive = False   # llhttp's verdict from the version and Connection header
        self.head_done = False
        self.complete = False     # the current message ended where its framing said
        self.surplus = False      # bytes followed the final response
        self.sink: Callable[[bytes], None] | None = None  # where body bytes go
        self._fields = 0

    @property
    def final(self) -> bool:
        return self.head_done and self.status >= 200

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Raises what the callbacks raised (our policy) or BadResponse (llhttp's verdict)."""
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise BadResponse("a protocol switch (101)") from None
        except httptools.HttpParserError as exc:
            if self.complete and self.final:
                self.surplus = True  # the response is whole; what came after is not read
                return
            if isinstance(exc, httptools.HttpParserCallbackError) and exc.__context__ is not None:
                raise exc.__context__ from None  # BadResponse, BodyTooLarge, SegmentUnavailable
            raise BadResponse(f"llhttp: {exc}") from None

    # --- llhttp's callbacks ---
    def on_message_begin(self) -> None:
        if self.complete and self.final:
            raise _Surplus()
        self.headers, self._fields = CIMultiDict(), 0
        self.head_done = self.complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1  # trailers count against the same limit, section by section
        if self._fields > HTTP_MAX_HEADERS:
            raise BadResponse(f"more than {HTTP_MAX_HEADERS} header lines")
        if not self.head_done:
            self.headers.add(name.decode("latin-1"), value.strip(b" \t").decode("latin-1"))

    def on_headers_complete(self) -> None:
        self.head_done, self._fields = True, 0
        self.status = self._parser.get_status_code()
        version = _VERSIONS.get(self._parser.get_http_version())
        if version is None:
            raise BadResponse(f"HTTP/{self._parser.get_http_version()}")
        self.version = version
        self.keep_alive = self._parser.should_keep_alive()

    def on_body(self, data: bytes) -> None:
        if self.sink is None:
            raise BadResponse("a body where none may be")  # a 1xx with a length, say
        self.sink(data)

    def on_message_complete(self) -> None:
        self.complete = True


class _Room(Protocol):
    """Where a body is read to: a shared-memory ``Segment`` (images) or ``_Memory`` (answers)."""

    def window(self, offset: int) -> memoryview: ...


class _Memory:
    """Room for a small body in this process's memory, read to as a segment is."""

    def __init__(self, size: int):
        self.data = bytearray(size)
        self._view = memoryview(self.data)

    def window(self, offset: int) -> memoryview:
        return self._view[offset:]


class _SegmentWriter:
    """Appends llhttp's body pieces to a segment, each copied once, the cap checked first."""

    def __init__(self, segment: _Room, max_bytes: int):
        self._segment = segment
        self._max_bytes = max_bytes
        self.size = 0

    def write(self, data: bytes) -> None:
        end = self.size + len(data)
        source = memoryview(data)[:self._max_bytes - self.size]  # filled to the cap, for read_prefix
        while source:
            window = self._segment.window(self.size)[:len(source)]
            window[:] = source[:len(window)]
            source = source[len(window):]
            self.size += len(window)
        if end > self._max_bytes:
            raise BodyTooLarge(end)


class _Connection(asyncio.BufferedProtocol):
    """One socket. Reads land in the thread's scratch buffer (heads, copied out at once), in the
    thread's stream buffer while llhttp takes a chunked body (``stream``) or, while a caller
    waits in ``read_into``, straight into the caller's memory."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout: float):
        self._loop = loop
        self._read_timeout = read_timeout
        self.transport: asyncio.Transport | None = None
        self._pending = bytearray()   # received, not yet consumed
        self._target: memoryview | None = None
        self._filled = 0
        self._stream: _Exchange | None = None  # takes the bytes as they arrive
        self._stream_error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last_data = 0.0
        self.eof = False
        self.clean_eof = False        # the peer ended its stream, with close_notify over TLS
        self.error: BaseException | None = None
        self.received_any = False     # in the current exchange
        self.first_byte_at = 0.0      # loop time the current exchange's first byte arrived
        self.idle_since = 0.0

    # --- transport callbacks ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._filled:]
        if self._stream is not None:
            return _stream_buffer()
        return _scratch_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self._last_data = self._loop.time()
        if not self.received_any:
            self.received_any, self.first_byte_at = True, self._last_data
        if self._target is not None:
            self._filled += nbytes
            if self._filled == len(self._target):
                self._target = None
                self._wake()
            return
        if self._stream is not None:
            self._consume(_stream_buffer()[:nbytes])
            return
        self._pending += _scratch_buffer()[:nbytes]
        if len(self._pending) > HTTP_MAX_HEAD_BYTES + HTTP_SCRATCH_BYTES and self.transport is not None:
            self.transport.pause_reading()  # nobody is reading: a peer may not fill our memory
        self._wake()

    def _consume(self, data: memoryview) -> None:
        """Feeds llhttp at once, so the stream buffer is free again when this returns; wakes
        the reader only at the end (silence is timed from ``_last_data`` all the same)."""
        stream = self._stream
        assert stream is not None  # buffer_updated streams only while an exchange is set
        try:
            stream.feed(data)
        except Exception as exc:  # noqa: BLE001 - for the reader to raise; a transport callback must not
            self._stream, self._stream_error = None, exc
            self._wake()
            return
        if stream.complete:
            self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self.clean_eof = _closed_cleanly(self.transport)
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        if exc is not None and self.error is None:
            self.error = exc
        self._target = None
        self._wake()

    # --- waiting ---
    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _wait(self) -> None:
        """Until more bytes, the end, or ``read_timeout`` seconds of silence."""
        if self.transport is not None and not self.eof and not self.transport.is_reading():
            self.transport.resume_reading()
        self._last_data = self._loop.time()  # silence counts from now, or from the last bytes
        self._waiter = self._loop.create_future()
        self._timer = self._loop.call_later(self._read_timeout, self._check_silence)
        try:
            await self._waiter
        finally:
            self._timer.cancel()
            self._waiter = None

    def _check_silence(self) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        quiet = self._loop.time() - self._last_data
        if quiet >= self._read_timeout:
            waiter.set_exception(TimeoutError(f"no data for {self._read_timeout} s"))
        else:
            self._timer = self._loop.call_later(self._read_timeout - quiet, self._check_silence)

    def _ended(self) -> Exception:
        return Disconnected(repr(self.error) if self.error else "the server closed the connection")

    # --- reading, for the response parser ---
    async def read_until(self, delimiter: bytes, limit: int) -> bytes:
        """Consumed bytes up to and including ``delimiter``, at most ``limit`` of them."""
        start = 0
        while True:
            end = self._pending.find(delimiter, start)
            if end >= 0:
                end += len(delimiter)
                if end > limit:
                    break
                line = bytes(self._pending[:end])
                del self._pending[:end]
                return line
            if len(self._pending) > limit:
                break
            if self.eof:
                raise self._ended()
            start = max(0, len(self._pending) - len(delimiter) + 1)
            await self._wait()
        raise BadResponse(f"no {delimiter!r} within {limit} bytes")

    async def read_into(self, target: memoryview) -> int:
        """Fills ``target``; fewer bytes only if the connection ended (the count says)."""
        taken = min(len(self._pending), len(target))
        if taken:
            target[:taken] = self._pending[:taken]
            del self._pending[:taken]
        if taken == len(target) or self.eof:
            return taken
        self._target, self._filled = target, taken
        try:
            while self._target is not None and not self.eof:
                await self._wait()
        finally:
            self._target = None
        return self._filled

    async def stream(self, exchange: _Exchange) -> None:
        """Feeds llhttp every byte as it arrives (never gathered) until the response is complete."""
        if self._pending:
            pending, self._pending = self._pending, bytearray()
            exchange.feed(pending)
        self._stream, self._stream_error = exchange, None
        try:
            while not exchange.complete:
                if self._stream_error is not None:
                    raise self._stream_error
                if self.eof:
                    raise self._ended()
                await self._wait()
        finally:
            self._stream = None

    # --- lifecycle ---
    @property
    def reusable(self) -> bool:
        return not self.eof and not self._pending and self.transport is not None \
            and not self.transport.is_closing()

    def write(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            raise Disconnected("the connection is closed")
        self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.eof = True


_stream_buffers = threading.local()
_scratch_buffers = threading.local()


def _scratch_buffer() -> memoryview:
    """The receive buffer of heads, one per thread (so per event loop) for all its connections:
    asyncio fills it and calls ``buffer_updated`` in one step, which copies the bytes out
    before any other read (docs/decisions.md, "Fleet scale"). A view, never the bytearray:
    asyncio's TLS transport fills the rest of a buffer through buf[offset:], which for a
    bytearray is a copy."""
    buffer = getattr(_scratch_buffers, "view", None)
    if buffer is None:
        buffer = _scratch_buffers.view = memoryview(bytearray(HTTP_SCRATCH_BYTES))
    return buffer


def _stream_buffer() -> memoryview:
    """The receive buffer of chunked bodies, one per thread (so per event loop) for all its
    connections: llhttp consumes each read before the next one starts. A large one means
    fewer reads and loop turns per body: through the 64 KiB scratch buffer a chunked 3.5 MB
    body cost 1.8-2.5 ms of CPU, 1.3-2.0 through this one (Content-Length: 1.0-1.3)."""
    buffer = getattr(_stream_buffers, "view", None)
    if buffer is None:
        buffer = _stream_buffers.view = memoryview(bytearray(HTTP_STREAM_BUFFER_BYTES))
    return buffer


def _closed_cleanly(transport: asyncio.BaseTransport | None) -> bool:
    """Whether the peer ended its stream on purpose. asyncio calls ``eof_received`` both for a
    TLS close_notify and for a bare TCP FIN (which an attacker or a middlebox can forge to cut a
    body short); only after a close_notify does the TLS object read as ended (b"") instead of
    wanting more bytes."""
    tls = transport.get_extra_info("ssl_object") if transport is not None else None
    if tls is None:
        return True
    try:
        return tls.read(1) == b""
    except ssl.SSLError:
        return False


@dataclass
class Response:
    version: int  # the minor version: 0 or 1
    status: int
    headers: CIMultiDictProxy[str]
    _connection: _Connection
    _exchange: _Exchange
    _complete: bool = False  # read to its exact end, so the connection may carry another
    # Seconds from the request's last byte written to the response's first byte received:
    # the site's queueing and work, which the monitor's adaptive back-off watches.
    ttfb: float = 0.0

    @property
    def content_length(self) -> int | None:
        return _content_length(self.headers)

    @property
    def reusable(self) -> bool:
        return self._complete and self._exchange.keep_alive and not self._exchange.surplus \
            and self._connection.reusable

    async def read_body(self, segments: SegmentPool, max_bytes: int) -> Body:
        """The whole body, in a segment from ``segments``; BodyTooLarge past ``max_bytes``."""
        framing = self._framing(max_bytes)
        if framing is None:
            return Body()
        segment = segments.take()
        body = Body(0, segment, segments)
        try:
            body.size = await self._read_framed(segment, *framing, max_bytes)
            return _decoded(body, self.headers, max_bytes)
        except BaseException:
            body.release()
            raise

    async def read_answer(self, max_bytes: int) -> bytes:
        """The whole body, when it is small (an S3 error document), read as ``read_body`` reads
        one but into this process's memory; BodyTooLarge past ``max_bytes``."""
        framing = self._framing(max_bytes)
        if framing is None:
            return b""
        length = framing[0]
        memory = _Memory(max_bytes + 1 if length is None else length)
        size = await self._read_framed(memory, *framing, max_bytes)
        return bytes(memory.data[:size])

    async def read_prefix(self, limit: int) -> bytes:
        """The body's first ``limit`` bytes, undone of a gzip or deflate coding: a longer body
        is cut there and its connection closed (a rules file, read as far as it is parsed)."""
        framing = self._framing(math.inf)
        if framing is None:
            return b""
        length, chunked = framing
        memory = _Memory(limit + 1)
        try:
            if length is not None and length > limit:
                size = await self._read_exactly(memory, limit)  # not to its end: not reused
            else:
                size = await self._read_framed(memory, length, chunked, limit)
        except BodyTooLarge:
            size = limit  # chunked or until the close: the room was filled to the cap first
        return _prefix_decoded(bytes(memory.data[:size]), self.headers, limit)

    def _framing(self, max_bytes: float) -> tuple[int | None, bool] | None:
        """The body's length (if it says one) and whether it is chunked; None if the head ended
        the response; BodyTooLarge if it says it is longer than ``max_bytes``."""
        if self.status in _NO_BODY_STATUSES or self._exchange.complete:
            self._complete = True  # llhttp ended it with the head (Content-Length: 0, say)
            return None
        # llhttp refuses a length beside chunked, so at most one of them is set
        length, chunked = self.content_length, _is_chunked(self.headers)
        if length is not None and length > max_bytes:
            raise BodyTooLarge(length)
        return length, chunked

    async def _read_framed(self, room: _Room, length: int | None, chunked: bool, max_bytes: int) -> int:
        if chunked:
            size = await self._read_chunked(room, max_bytes)
        elif length is not None:
            size = await self._read_exactly(room, length)
        else:
            size = await self._read_to_close(room, max_bytes)
        self._complete = chunked or length is not None  # the framing said where it ends
        return size

    async def _read_exactly(self, segment: _Room, count: int) -> int:
        offset = 0
        while offset < count:
            window = segment.window(offset)[:count - offset]
            got = await self._connection.read_into(window)
            offset += got
            if got < len(window):
                raise Disconnected(f"the body ended {count - offset} bytes short")
        return count

    async def _read_to_close(self, segment: _Room, max_bytes: int) -> int:
        connection, offset = self._connection, 0
        while True:
            window = segment.window(offset)
            if not len(window):
                raise BodyTooLarge(offset)
            got = await connection.read_into(window)
            offset += got
            if offset > max_bytes:
                raise BodyTooLarge(offset)
            if got < len(window):  # the connection ended: the end of the body if cleanly closed
                if connection.error is not None or not connection.clean_eof:
                    reason = repr(connection.error) if connection.error else "no TLS close_notify"
                    raise Disconnected(f"cut after {offset} bytes: {reason}")
                return offset

    async def _read_chunked(self, segment: _Room, max_bytes: int) -> int:
        writer = _SegmentWriter(segment, max_bytes)
        self._exchange.sink = writer.write
        try:
            await self._connection.stream(self._exchange)
        finally:
            self._exchange.sink = None
        return writer.size


class Answer(NamedTuple):
    """A PUT's answer: small, so read whole into memory."""
    status: int
    body: bytes


class Ready(NamedTuple):
    """A connection to write a request on at once, and whether it served one before (a
    server may have closed it meanwhile: the request is then retried once on a new one).
    ``send_by``: the monotonic time past which the request must not be written (its token's)."""
    connection: _Connection
    reused: bool
    send_by: float | None = None


class HttpClient:
    def __init__(self, user_agent: str, resolver=None, timeouts: Timeouts = Timeouts(),
                 ssl_context: ssl.SSLContext | None = None):
        """``resolver`` is an aiohttp ``AbstractResolver`` (the SSRF guard's ``GuardedResolver``
        in the worker); None resolves with the system's resolver, unchecked."""
        self._user_agent = user_agent
        self._resolver = resolver
        self._resolved = AddressCache(self._lookup)
        self._timeouts = timeouts
        self._ssl = ssl_context or ssl.create_default_context()
        self._idle: dict[Origin, deque[_Connection]] = defaultdict(deque)
        self._idle_order: OrderedDict[_Connection, Origin] = OrderedDict()  # the longest idle first
        self._next_sweep = 0.0
        self._sweeper: asyncio.TimerHandle | None = None  # pending while connections are idle
        self._closed = False

    @property
    def idle_connections(self) -> int:
        """How many keep-alive connections sit idle in the pool, over all origins."""
        return len(self._idle_order)

    def idle(self, url: str) -> Ready | None:
        """An idle keep-alive connection to ``url``'s origin, taken from the pool; None if none."""
        connection = self._idle_connection(url_origin(url))
        return Ready(connection, reused=True) if connection is not None else None

    async def connect(self, url: str) -> Ready:
        """A new connection to ``url``'s origin (resolved through the guard)."""
        return Ready(await self._connect(*url_origin(url)), reused=False)

    def give_back(self, url: str, ready: Ready) -> None:
        """A connection not used after all: idle again, for the next request to its origin."""
        self._keep(url_origin(url), ready.connection)

    @asynccontextmanager
    async def get(self, url: str, ready: Ready | None = None, encoded: bool = False,
                  origin: Origin | None = None) -> AsyncIterator[Response]:
        """A GET of ``url``, its head read. The caller reads the body (or not) inside the block;
        the connection is kept for another request only if the response was read to its end.
        With ``ready`` (from ``idle`` or ``connect``) the request bytes are written at once,
        before any wait: the fetcher takes its token with the connection in hand. ``encoded``:
        ``url`` is sent exactly as given (a presigned URL, as signed), with ``origin`` if known."""
        origin = origin or url_origin(url)  # the host the guard judged; InvalidHost (a ValueError) if none
        head = _request_head("GET", URL(url, encoded=encoded), self._user_agent, _GET_HEADERS)
        async with self._exchange(origin, (head,), ready) as response:
            yield response

    async def put(self, url: str, body: bytes, content_type: str, max_answer_bytes: int,
                  origin: Origin | None = None) -> Answer:
        """A PUT of ``body`` to ``url``, sent exactly as given (already percent-encoded: a
        presigned URL is sent as it was signed), and the answer: BodyTooLarge if its body is
        longer than ``max_answer_bytes``. For the thumbnail store, a small answer each.
        ``origin``: ``url``'s, if the caller knows it (a store's URLs share one; reading it
        out of each signed URL was ~2% of a worker's CPU)."""
        head = _request_head("PUT", URL(url, encoded=True), self._user_agent,
                             f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n")
        async with self._exchange(origin or url_origin(url), (head, body)) as response:
            return Answer(response.status, await response.read_answer(max_answer_bytes))

    @asynccontextmanager
    async def _exchange(self, origin: Origin, request: tuple[bytes, ...],
                        ready: Ready | None = None) -> AsyncIterator[Response]:
        send_by = ready.send_by if ready is not None else None
        for attempt in (1, 2):
            if attempt == 1 and ready is not None:
                connection, reused = ready.connection, ready.reused
            else:
                idle = self._idle_connection(origin) if attempt == 1 else None
                reused = idle is not None
                connection = idle if idle is not None else await self._connect(*origin)
            # Judged with the head built, just before writing (a retry on a new connection too).
            if send_by is not None and (late_by := time.monotonic() - send_by) > 0:
                self._keep(origin, connection)  # unused: fit for the next request
                raise TooLate(late_by)
            try:
                connection.received_any = False
                for part in request:
                    connection.write(part)
                sent_at = self._loop_time()
                exchange = await _read_head(connection)
                break
            except Disconnected:
                connection.close()
                if reused and not connection.received_any:
                    continue  # the server had closed it while idle: once more, on a new one
                raise
            except BaseException:
                connection.close()
                raise
        response = Response(exchange.version, exchange.status, CIMultiDictProxy(exchange.headers),
                            connection, exchange, ttfb=max(0.0, connection.first_byte_at - sent_at))
        try:
            yield response
        finally:
            if response.reusable:
                self._keep(origin, connection)
            else:
                connection.close()

    @staticmethod
    def _loop_time() -> float:
        return asyncio.get_running_loop().time()

    def _idle_connection(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        found = None
        while idle and found is None:
            connection = idle.pop()
            del self._idle_order[connection]
            if _fit(connection, time.monotonic()):
                found = connection
            else:
                connection.close()
        if idle is not None and not idle:
            del self._idle[origin]
        return found

    def _keep(self, origin: Origin, connection: _Connection) -> None:
        if time.monotonic() > self._next_sweep:
            self._sweep()
        if self._closed:
            connection.close()
            return
        # Full: the connection idle longest makes room (a site of one URL does not keep its
        # connection from a site whose next request comes within the second).
        while len(self._idle_order) >= HTTP_MAX_IDLE_CONNECTIONS:
            self._drop(*next(iter(self._idle_order.items())))
        connection.idle_since = time.monotonic()
        self._idle[origin].append(connection)
        self._idle_order[connection] = origin
        if self._sweeper is None:  # a timer, so a crawl that stops leaves no sockets open
            self._sweeper = asyncio.get_running_loop().call_later(IDLE_SWEEP_SECONDS, self._timed_sweep)

    def _timed_sweep(self) -> None:
        self._sweeper = None
        self._sweep()
        if self._idle_order and not self._closed:
            self._sweeper = asyncio.get_running_loop().call_later(IDLE_SWEEP_SECONDS, self._timed_sweep)

    def _sweep(self) -> None:
        """Drops idle connections that expired or that their servers closed."""
        now = time.monotonic()
        self._next_sweep = now + HTTP_IDLE_SECONDS
        for connection, origin in list(self._idle_order.items()):
            if not _fit(connection, now):
                self._drop(connection, origin)

    def _drop(self, connection: _Connection, origin: Origin) -> None:
        """An idle connection out of the pool, and closed."""
        del self._idle_order[connection]
        idle = self._idle[origin]
        idle.remove(connection)
        if not idle:
            del self._idle[origin]
        connection.close()

    async def _connect(self, scheme: str, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._timeouts.connect):
            try:
                addresses = await self._resolved.addresses(host, port)
            except OSError as exc:  # the name does not resolve: a dead domain
                raise ConnectFailed(f"cannot resolve {host}: {exc}") from None
            errors = []
            for address in addresses:
                try:
                    _transport, connection = await loop.create_connection(
                        lambda: _Connection(loop, self._timeouts.read), address, port,
                        ssl=self._ssl if scheme == "https" else None,
                        server_hostname=host if scheme == "https" else None)
                    return connection
                except ssl.SSLError:
                    raise
                except OSError as exc:
                    errors.append(f"{address}: {exc}")
        raise ConnectFailed(f"cannot connect to {host}:{port}: {'; '.join(errors) or 'no address'}")

    async def _lookup(self, host: str, port: int) -> list[str]:
        """IP literals too go through the resolver: the guard's must see every address."""
        if self._resolver is None:
            return await system_resolve(host, port)
        # May raise Refused: the host resolves only to forbidden addresses.
        return [result["host"] for result in await self._resolver.resolve(host, port, family=socket.AF_UNSPEC)]

    async def close(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
        self._idle_order.clear()
        if self._resolver is not None:
            await self._resolver.close()


# --- the wire ------------------------------------------------------------------
_GET_HEADERS = "Accept: */*\r\nAccept-Encoding: identity\r\n"


def _request_head(method: str, url: URL, user_agent: str, headers: str) -> bytes:
    host = url.raw_host or ""  # url_origin refused a URL without one
    host = host if ":" not in host else f"[{host}]"
    if not url.is_default_port():
        host = f"{host}:{url.port}"
    target = url.raw_path_qs or "/"
    if _UNSAFE.search(target + host):  # yarl quotes what it can; never let the rest split a line
        raise ValueError(f"cannot send {str(url)[:200]!r}")
    return f"{method} {target} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: {user_agent}\r\n{headers}\r\n".encode("latin-1")


async def _read_head(connection: _Connection) -> _Exchange:
    """llhttp's reading of the final head. Only the bytes up to the first empty line go to
    llhttp (it ends a head nowhere else): the body, if any, stays in the connection."""
    exchange = _Exchange()
    for _interim in range(HTTP_MAX_INTERIM_RESPONSES + 1):
        # 1xx answers (100 Continue, 103 Early Hints) may come before the real one
        exchange.feed(await connection.read_until(b"\r\n\r\n", HTTP_MAX_HEAD_BYTES))
        if not exchange.head_done:
            raise BadResponse("llhttp did not read a whole head")
        if exchange.status < 100:
            raise BadResponse(f"unexpected status {exchange.status}")
        if exchange.status >= 200:
            return exchange
        if not exchange.complete:
            raise BadResponse(f"a {exchange.status} response with a body")
    raise BadResponse(f"more than {HTTP_MAX_INTERIM_RESPONSES} interim (1xx) responses")


def _content_length(headers: CIMultiDictProxy[str]) -> int | None:
    """llhttp refused repeated, listed and non-digit lengths; ``int`` alone would also take
    "1_0" or Unicode digits, so the digits are checked once more."""
    value = headers.get("Content-Length")
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()) or len(value) > HTTP_MAX_LENGTH_DIGITS:
        raise BadResponse(f"bad Content-Length {value[:20]!r}")
    return int(value)


def _is_chunked(headers: CIMultiDictProxy[str]) -> bool:
    """Only ``chunked``, once: we asked for no coding, and any other list could be read as
    chunked by llhttp and not by us, or the other way round."""
    codings = [c.strip(" \t").lower() for value in headers.getall("Transfer-Encoding", [])
               for c in value.split(",")]
    if not codings:
        return False
    if codings != ["chunked"]:
        raise BadResponse(f"unsupported Transfer-Encoding {', '.join(codings)[:100]!r}")
    return True


def _decoded(body: Body, headers: CIMultiDictProxy[str], max_bytes: int) -> Body:
    """The body undone of a gzip or deflate encoding that a server applied unasked."""
    encoding = headers.get("Content-Encoding", "identity").lower()  # values come OWS-stripped
    if encoding in ("identity", ""):
        return body
    wbits = _DECODERS.get(encoding)
    if wbits is None:
        return body  # left as sent: the image decoder will say it is not an image
    try:
        try:
            data = _decompress(body.bytes(), wbits, max_bytes + 1)
        except zlib.error:
            if encoding != "deflate":
                raise
            data = _decompress(body.bytes(), -zlib.MAX_WBITS, max_bytes + 1)  # raw, by that name
    except (zlib.error, EOFError, ValueError) as exc:
        raise BadResponse(f"bad {encoding} body: {exc}") from None
    finally:
        body.release()
    if len(data) > max_bytes:
        raise BodyTooLarge(len(data))
    return Body.of(data)


def _fit(connection: _Connection, now: float) -> bool:
    """Whether an idle connection may carry another request: open, and not idle too long."""
    return connection.reusable and now - connection.idle_since < HTTP_IDLE_SECONDS


def _prefix_decoded(data: bytes, headers: CIMultiDictProxy[str], limit: int) -> bytes:
    """At most ``limit`` bytes of ``data`` undone of a gzip or deflate coding, read as far as
    they go (a body cut at the cap is a prefix of the stream); BadResponse if it is not one."""
    wbits = _DECODERS.get(headers.get("Content-Encoding", "identity").lower())
    if wbits is None:
        return data
    for bits in (wbits, -zlib.MAX_WBITS) if wbits != _GZIP else (wbits,):  # deflate: zlib's, or raw
        try:
            return zlib.decompressobj(bits).decompress(data, limit)
        except zlib.error as exc:
            error = exc
    raise BadResponse(f"bad encoded body: {error}")


def _decompress(data: bytes, wbits: int, limit: int) -> bytes:
    """At most ``limit`` bytes of the decoded stream, every gzip member of it (a decoder stops
    after the first, and the rest of the image would be lost without a word); EOFError if it is
    cut short, ValueError if anything but another gzip member follows it."""
    parts, room = [], limit
    while True:
        decoder = zlib.decompressobj(wbits)
        parts.append(decoder.decompress(data, room))
        room -= len(parts[-1])
        if room <= 0:
            break
        if not decoder.eof:
            raise EOFError("the stream ends early")
        data = decoder.unused_data
        if not data:
            break
        if wbits != _GZIP:
            raise ValueError(f"{len(data)} bytes after the stream")
    return b"".join(parts)
