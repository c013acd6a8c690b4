"""The HTTP/1.1 client that downloads images: bodies land in shared memory.

Only image GETs go through it (robots.txt, S3 and the rest use aiohttp). It
exists for one reason: aiohttp's parser copies every body once more, and the
body then had to be copied again into memory the pool processes can read. On
12 MP photos those two passes over a cache-cold 3.5 MB were about half of
the worker's CPU per image (``bench.worker_images``). Here the socket is read
(``asyncio.BufferedProtocol``) straight into a ``shared_memory.Segment``.

What it does, and no more: keep-alive connections per origin (a stale one is
retried once on a fresh connection), TLS with the system's certificates,
address resolution through an injected resolver (the SSRF guard's), the
three timeouts (connect, silence, and the caller's total), ``Content-Length``,
chunked and read-until-close bodies, and a size cap checked as bytes arrive.
It asks for ``identity`` encoding and takes gzip or deflate from servers that
send them anyway. Everything a server sends is untrusted: heads are bounded
in size and count, and framing that cannot be trusted (conflicting lengths,
unknown transfer codings) is refused as ``BadResponse``; a connection is
reused only after a response that was read to its exact end.
"""
from __future__ import annotations

import asyncio
import re
import socket
import ssl
import time
import zlib
from collections import defaultdict, deque
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from common.hosts import Origin, url_origin
from worker.constants import (CONNECT_TIMEOUT, HTTP_IDLE_SECONDS, HTTP_MAX_HEAD_BYTES,
                              HTTP_MAX_HEADERS, HTTP_MAX_IDLE_CONNECTIONS,
                              HTTP_MAX_INTERIM_RESPONSES, HTTP_SCRATCH_BYTES,
                              READ_TIMEOUT)
from worker.politeness.addresses import system_resolve
from worker.shared_memory import Body, SegmentPool


class BadResponse(Exception):
    """The server's answer breaks HTTP/1.1 in a way that makes its framing untrustworthy."""


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


_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: [^\r\n]*)?")
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_FIELD_VALUE = re.compile(rb"[^\x00-\x08\x0a-\x1f\x7f]*")  # no control characters but tab
_DIGITS = re.compile(r"[0-9]{1,15}")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,15})[ \t]*(?:;[^\r\n]*)?")
_UNSAFE = re.compile(r"[\x00-\x20\x7f]")
_DECODERS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
_NO_BODY_STATUSES = frozenset({204, 304})


class _Connection(asyncio.BufferedProtocol):
    """One socket. Reads land in a scratch buffer (heads, chunk sizes) or, while a caller
    waits in ``read_into``, straight into the caller's memory."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout: float):
        self._loop = loop
        self._read_timeout = read_timeout
        self.transport: asyncio.Transport | None = None
        self._scratch = bytearray(HTTP_SCRATCH_BYTES)
        # A view, never the bytearray: asyncio's TLS transport fills the rest of a buffer
        # through buf[offset:], which for a bytearray is a copy (those bytes were lost).
        self._scratch_view = memoryview(self._scratch)
        self._pending = bytearray()   # received, not yet consumed
        self._target: memoryview | None = None
        self._filled = 0
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last_data = 0.0
        self.eof = False
        self.error: BaseException | None = None
        self.received_any = False     # in the current exchange
        self.idle_since = 0.0

    # --- transport callbacks ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._filled:]
        return self._scratch_view

    def buffer_updated(self, nbytes: int) -> None:
        self._last_data = self._loop.time()
        self.received_any = True
        if self._target is not None:
            self._filled += nbytes
            if self._filled == len(self._target):
                self._target = None
                self._wake()
            return
        self._pending += self._scratch_view[:nbytes]
        if len(self._pending) > HTTP_MAX_HEAD_BYTES + HTTP_SCRATCH_BYTES:
            self.transport.pause_reading()  # nobody is reading: a peer may not fill our memory
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
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

    # --- lifecycle ---
    @property
    def reusable(self) -> bool:
        return not self.eof and not self._pending and self.transport is not None \
            and not self.transport.is_closing()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.eof = True


@dataclass
class Response:
    version: int  # the minor version: 0 or 1
    status: int
    headers: CIMultiDictProxy[str]
    _connection: _Connection
    _complete: bool = False  # read to its exact end, so the connection may carry another

    @property
    def content_length(self) -> int | None:
        return _content_length(self.headers)

    async def read_body(self, segments: SegmentPool, max_bytes: int) -> Body:
        """The whole body, in a segment from ``segments``; BodyTooLarge past ``max_bytes``."""
        if self.status in _NO_BODY_STATUSES:
            self._complete = True
            return Body()
        length, chunked = self.content_length, _is_chunked(self.headers)
        if length is not None and length > max_bytes and not chunked:
            raise BodyTooLarge(length)
        body = Body(0, segments.take(), segments)
        try:
            if chunked:
                body.size = await self._read_chunked(body.segment, max_bytes)
            elif length is not None:
                body.size = await self._read_exactly(body.segment, 0, length)
            else:
                body.size = await self._read_to_close(body.segment, max_bytes)
            # The connection may carry another request only if the framing said where the
            # body ends, and said it once (both a length and chunked smell of smuggling).
            self._complete = chunked != (length is not None)
            return _decoded(body, self.headers, max_bytes)
        except BaseException:
            body.release()
            raise

    async def _read_exactly(self, segment, offset: int, count: int) -> int:
        end = offset + count
        while offset < end:
            window = segment.window(offset)
            window = window[:end - offset]
            got = await self._connection.read_into(window)
            offset += got
            if got < len(window):
                raise Disconnected(f"the body ended {end - offset} bytes short")
        return end

    async def _read_to_close(self, segment, max_bytes: int) -> int:
        offset = 0
        while True:
            window = segment.window(offset)
            if not len(window):
                raise BodyTooLarge(offset)
            got = await self._connection.read_into(window)
            offset += got
            if offset > max_bytes:
                raise BodyTooLarge(offset)
            if got < len(window):  # the connection ended: the end of the body if cleanly closed
                if self._connection.error is not None:
                    raise Disconnected(f"reset after {offset} bytes: {self._connection.error!r}")
                return offset

    async def _read_chunked(self, segment, max_bytes: int) -> int:
        connection, offset = self._connection, 0
        while True:
            line = await connection.read_until(b"\n", HTTP_MAX_HEAD_BYTES)
            match = _CHUNK_SIZE.fullmatch(line.rstrip(b"\r\n"))
            if match is None:
                raise BadResponse("bad chunk size line")
            size = int(match.group(1), 16)
            if size == 0:
                break
            if offset + size > max_bytes:
                raise BodyTooLarge(offset + size)
            offset = await self._read_exactly(segment, offset, size)
            if await connection.read_until(b"\n", 2) not in (b"\r\n", b"\n"):
                raise BadResponse("chunk not followed by CRLF")
        trailers = 0
        while await connection.read_until(b"\n", HTTP_MAX_HEAD_BYTES) not in (b"\r\n", b"\n"):
            trailers += 1
            if trailers > HTTP_MAX_HEADERS:
                raise BadResponse("too many trailers")
        return offset


class HttpClient:
    def __init__(self, user_agent: str, resolver=None, timeouts: Timeouts = Timeouts(),
                 ssl_context: ssl.SSLContext | None = None):
        """``resolver`` is an aiohttp ``AbstractResolver`` (the SSRF guard's ``GuardedResolver``
        in the worker); None resolves with the system's resolver, unchecked."""
        self._user_agent = user_agent
        self._resolver = resolver
        self._timeouts = timeouts
        self._ssl = ssl_context or ssl.create_default_context()
        self._idle: dict[Origin, deque[_Connection]] = defaultdict(deque)
        self._idle_count = 0
        self._next_sweep = 0.0
        self._closed = False

    @asynccontextmanager
    async def get(self, url: str) -> AsyncIterator[Response]:
        """A GET of ``url``, its head read. The caller reads the body (or not) inside the block;
        the connection is kept for another request only if the response was read to its end."""
        origin = url_origin(url)  # the host the guard judged; InvalidHost (a ValueError) if none
        target = URL(url)
        request = _request_bytes(target, self._user_agent)
        for attempt in (1, 2):
            connection = self._idle_connection(origin) if attempt == 1 else None
            reused = connection is not None
            if connection is None:
                connection = await self._connect(*origin)
            try:
                connection.received_any = False
                connection.transport.write(request)
                version, status, headers = await _read_head(connection)
                break
            except Disconnected:
                connection.close()
                if reused and not connection.received_any:
                    continue  # the server had closed it while idle: once more, on a new one
                raise
            except BaseException:
                connection.close()
                raise
        response = Response(version, status, headers, connection)
        try:
            yield response
        finally:
            if response._complete and _keeps_alive(version, headers) and connection.reusable:
                self._keep(origin, connection)
            else:
                connection.close()

    def _idle_connection(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            self._idle_count -= 1
            if connection.reusable and time.monotonic() - connection.idle_since < HTTP_IDLE_SECONDS:
                return connection
            connection.close()
        return None

    def _keep(self, origin: Origin, connection: _Connection) -> None:
        if self._idle_count >= HTTP_MAX_IDLE_CONNECTIONS or time.monotonic() > self._next_sweep:
            self._sweep()
        if self._closed or self._idle_count >= HTTP_MAX_IDLE_CONNECTIONS:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        self._idle[origin].append(connection)
        self._idle_count += 1

    def _sweep(self) -> None:
        """Drops idle connections that expired or that their servers closed."""
        now = time.monotonic()
        self._next_sweep = now + HTTP_IDLE_SECONDS
        for origin in list(self._idle):
            idle = self._idle[origin]
            kept = deque(c for c in idle if c.reusable and now - c.idle_since < HTTP_IDLE_SECONDS)
            for connection in set(idle) - set(kept):
                connection.close()
            self._idle_count -= len(idle) - len(kept)
            if kept:
                self._idle[origin] = kept
            else:
                del self._idle[origin]

    async def _connect(self, scheme: str, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._timeouts.connect):
            try:
                addresses = await self._addresses(host, port)
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

    async def _addresses(self, host: str, port: int) -> list[str]:
        """IP literals too go through the resolver: the guard's must see every address."""
        if self._resolver is None:
            return await system_resolve(host, port)
        # May raise Refused: the host resolves only to forbidden addresses.
        return [result["host"] for result in await self._resolver.resolve(host, port, family=socket.AF_UNSPEC)]

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
        self._idle_count = 0
        if self._resolver is not None:
            await self._resolver.close()


# --- the wire ------------------------------------------------------------------
def _request_bytes(url: URL, user_agent: str) -> bytes:
    host = url.raw_host if ":" not in url.raw_host else f"[{url.raw_host}]"
    if not url.is_default_port():
        host = f"{host}:{url.port}"
    target = url.raw_path_qs or "/"
    if _UNSAFE.search(target + host):  # yarl quotes what it can; never let the rest split a line
        raise ValueError(f"cannot send {str(url)[:200]!r}")
    return (f"GET {target} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: {user_agent}\r\n"
            "Accept: */*\r\nAccept-Encoding: identity\r\n\r\n").encode("latin-1")


async def _read_head(connection: _Connection) -> tuple[int, int, CIMultiDictProxy[str]]:
    for _interim in range(HTTP_MAX_INTERIM_RESPONSES + 1):
        # 1xx answers (100 Continue, 103 Early Hints) may come before the real one
        head = await connection.read_until(b"\r\n\r\n", HTTP_MAX_HEAD_BYTES)
        lines = head[:-4].split(b"\r\n")
        status = _STATUS_LINE.fullmatch(lines[0])
        if status is None:
            raise BadResponse(f"bad status line {lines[0][:100]!r}")
        if len(lines) - 1 > HTTP_MAX_HEADERS:
            raise BadResponse("too many header lines")
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or _TOKEN.fullmatch(name) is None or _FIELD_VALUE.fullmatch(value) is None:
                raise BadResponse(f"bad header line {line[:100]!r}")
            headers.add(name.decode("ascii"), value.strip(b" \t").decode("latin-1"))
        code = int(status.group(2))
        if code == 101 or code < 100:
            raise BadResponse(f"unexpected status {code}")
        if code >= 200:
            return int(status.group(1)), code, CIMultiDictProxy(headers)
    raise BadResponse(f"more than {HTTP_MAX_INTERIM_RESPONSES} interim (1xx) responses")


def _content_length(headers: CIMultiDictProxy[str]) -> int | None:
    values = {v.strip() for value in headers.getall("Content-Length", []) for v in value.split(",")}
    if not values:
        return None
    if len(values) != 1 or _DIGITS.fullmatch(next(iter(values))) is None:
        raise BadResponse(f"bad Content-Length {sorted(values)[:3]}")
    return int(values.pop())


def _is_chunked(headers: CIMultiDictProxy[str]) -> bool:
    codings = [c.strip().lower() for value in headers.getall("Transfer-Encoding", [])
               for c in value.split(",") if c.strip()]
    if not codings:
        return False
    if codings != ["chunked"]:  # we asked for none; anything else would need decoding
        raise BadResponse(f"unsupported Transfer-Encoding {', '.join(codings)[:100]}")
    return True


def _keeps_alive(version: int, headers: CIMultiDictProxy[str]) -> bool:
    tokens = {t.strip().lower() for value in headers.getall("Connection", []) for t in value.split(",")}
    return "close" not in tokens if version == 1 else "keep-alive" in tokens


def _decoded(body: Body, headers: CIMultiDictProxy[str], max_bytes: int) -> Body:
    """The body undone of a gzip or deflate encoding that a server applied unasked."""
    encoding = headers.get("Content-Encoding", "identity").strip().lower()
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
    except (zlib.error, EOFError) as exc:
        raise BadResponse(f"bad {encoding} body: {exc}") from None
    finally:
        body.release()
    if len(data) > max_bytes:
        raise BodyTooLarge(len(data))
    return Body.of(data)


def _decompress(data: bytes, wbits: int, limit: int) -> bytes:
    """At most ``limit`` bytes of the decoded stream; EOFError if it is cut short."""
    decoder = zlib.decompressobj(wbits)
    out = decoder.decompress(data, limit)
    if not decoder.eof and len(out) < limit:
        raise EOFError("the stream ends early")
    return out
