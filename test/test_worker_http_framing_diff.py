"""The image client's framing against llhttp itself, on a corpus of hostile responses.

Two parsers that disagree about where a response ends are how a crawler stores
truncated images or lets a site smuggle one response inside another. The
client leans on llhttp (``httptools``) for heads and chunked bodies but
receives byte-counted bodies itself, decodes gzip and deflate itself and adds
its own policy (limits, the transfer-coding allow-list): each of those is a
place where it could drift from the parser it claims to follow. So every
response of the corpus goes, as the exact bytes, both to a plain
``httptools.HttpResponseParser`` (the oracle) and to the client over a
loopback connection that the server closes after sending them; then:

- whatever llhttp refuses, the client refuses (an error: BadResponse,
  Disconnected or BodyTooLarge);
- whatever the client accepts, its body is llhttp's body (decoded as
  ``Content-Encoding`` says, by the standard library's own ``gzip`` and
  ``zlib``, where the response is encoded).

The client may refuse what llhttp accepts (its policy is stricter); it may
never be more lenient. The corpus is a readable list: add a case by adding a
line.
"""
from __future__ import annotations

import gzip
import zlib

import httptools
import pytest

from test.test_worker_http_client import (CHUNKED_HEAD, MAX, chunked, client, fetch, head, noise,  # noqa: F401
                                          ok, respond, serve)
from worker.fetching.http_client import BadResponse, BodyTooLarge, Disconnected

H = "HTTP/1.1 200 OK"
TE = "Transfer-Encoding: chunked"
GZ = "Content-Encoding: gzip"
DEFLATE = "Content-Encoding: deflate"
IMAGE = noise(3000, seed=21)
BIG = noise(MAX + 10, seed=22)


def _te(value: bytes, body: bytes = b"5\r\nhello\r\n0\r\n\r\n") -> bytes:
    return head(H, b"Transfer-Encoding: " + value) + body


def _cl(value: bytes, body: bytes = b"hello") -> bytes:
    return head(H, b"Content-Length: " + value) + body


def _chunks(framing: bytes) -> bytes:
    return CHUNKED_HEAD + framing


def _interim(count: int, status: str = "100 Continue") -> bytes:
    return head(f"HTTP/1.1 {status}") * count + ok(b"final")


CORPUS: list[tuple[str, bytes]] = [
    # --- well-formed: each framing, the statuses without a body, the versions ---
    ("cl", ok(IMAGE)),
    ("cl-empty", ok(b"")),
    ("cl-with-type", ok(IMAGE, "Content-Type: image/jpeg")),
    ("cl-leading-zeros", _cl(b"0005")),
    ("cl-trailing-space", _cl(b"5 ")),
    ("cl-tab", head(H, b"Content-Length:\t5\t") + b"hello"),
    ("cl-over-cap", ok(BIG)),
    ("cl-exactly-cap", ok(BIG[:MAX])),
    ("chunked", _chunks(chunked(IMAGE[:1000], IMAGE[1000:]))),
    ("chunked-tiny-pieces", _chunks(chunked(*[IMAGE[i:i + 7] for i in range(0, 700, 7)]))),
    ("chunked-empty", _chunks(b"0\r\n\r\n")),
    ("chunked-uppercase-hex", _chunks(b"00B\r\nhello world\r\n0\r\n\r\n")),
    ("chunked-extensions", _chunks(b"5;name=value\r\nhello\r\n6;a;b=\"x;y\"\r\n world\r\n0;last\r\n\r\n")),
    ("chunked-trailers", _chunks(chunked(b"hello", trailers=b"X-Checksum: abc\r\nX-Other: 1\r\n"))),
    ("chunked-over-cap", _chunks(chunked(BIG))),
    ("chunked-grows-over-cap", _chunks(chunked(*[b"c" * 1000] * (MAX // 1000 + 2)))),
    ("chunked-http1.0", head("HTTP/1.0 200 OK", TE) + chunked(b"hello")),
    ("until-close", head(H, "Content-Type: image/png") + IMAGE),
    ("until-close-empty", head(H)),
    ("until-close-over-cap", head(H) + BIG),
    ("http1.0-until-close", head("HTTP/1.0 200 OK") + IMAGE),
    ("http1.0-keep-alive", ok(b"body", "Connection: keep-alive", status="HTTP/1.0 200 OK")),
    ("connection-close", ok(b"body", "Connection: close")),
    ("connection-list", ok(b"body", "Connection: keep-alive, Close")),
    ("no-reason-phrase", b"HTTP/1.1 200\r\nContent-Length: 5\r\n\r\nhello"),
    ("empty-reason-phrase", b"HTTP/1.1 200 \r\nContent-Length: 5\r\n\r\nhello"),
    ("404", ok(b"gone", status="HTTP/1.1 404 Not Found")),
    ("204-with-length", head("HTTP/1.1 204 No Content", "Content-Length: 1234")),
    ("304-with-length", head("HTTP/1.1 304 Not Modified", "Content-Length: 1234")),
    ("204-with-chunked", head("HTTP/1.1 204 No Content", TE)),
    ("128-headers", ok(b"ok", *[f"X-H{i}: v" for i in range(127)])),
    ("header-value-obs-text", ok(b"ok", "X-Name: caf\xe9")),
    ("header-value-tab", ok(b"ok", "X-Name: a\tb")),
    # --- bytes after a whole response: never part of it ---
    ("cl-then-garbage", ok(b"ab") + b"GARBAGE"),
    ("cl-then-second-response", ok(b"ab") + ok(b"smuggled")),
    ("chunked-then-garbage", _chunks(chunked(b"ab")) + b"GARBAGE"),
    ("close-then-garbage", ok(b"ab", "Connection: close") + b"GARBAGE"),
    ("204-then-garbage", head("HTTP/1.1 204 No Content") + b"GARBAGE"),
    # --- status lines ---
    ("garbage", b"garbage\r\n\r\n"),
    ("http0.9", b"\x89PNG\r\n\x1a\n" + IMAGE),
    ("http2-preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
    ("http2-status", b"HTTP/2 200\r\n\r\n"),
    ("http2.0-status", b"HTTP/2.0 200 OK\r\nContent-Length: 5\r\n\r\nhello"),
    ("http1.2", b"HTTP/1.2 200 OK\r\nContent-Length: 5\r\n\r\nhello"),
    ("lowercase-http", b"http/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"),
    ("two-digit-status", b"HTTP/1.1 20 OK\r\n\r\n"),
    ("four-digit-status", b"HTTP/1.1 2000 OK\r\nContent-Length: 5\r\n\r\nhello"),
    ("status-099", b"HTTP/1.1 099 Low\r\nContent-Length: 5\r\n\r\nhello"),
    ("status-000", b"HTTP/1.1 000 Zero\r\nContent-Length: 5\r\n\r\nhello"),
    ("status-999", b"HTTP/1.1 999 High\r\nContent-Length: 5\r\n\r\nhello"),
    ("icy", b"ICY 200 OK\r\n\r\n"),
    ("leading-space", b" HTTP/1.1 200 OK\r\n\r\n"),
    ("leading-crlf", b"\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"),
    ("tab-in-status-line", b"HTTP/1.1\t200 OK\r\nContent-Length: 5\r\n\r\nhello"),
    ("two-spaces-in-status-line", b"HTTP/1.1  200 OK\r\nContent-Length: 5\r\n\r\nhello"),
    ("nul-in-reason", b"HTTP/1.1 200 O\x00K\r\nContent-Length: 5\r\n\r\nhello"),
    ("bare-lf-status-line", b"HTTP/1.1 200 OK\nContent-Length: 5\r\n\r\nhello"),
    ("bare-lf-everywhere", b"HTTP/1.1 200 OK\nContent-Length: 5\n\nhello"),
    ("101", b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n"),
    ("101-upgrade", head("HTTP/1.1 101 Switching Protocols", "Upgrade: websocket", "Connection: upgrade")
     + b"frames"),
    ("no-head-end", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n"),
    ("nothing", b""),
    # --- header lines ---
    ("129-headers", head(H, *[f"X-H{i}: v" for i in range(129)])),
    ("no-colon", head(H, "Content-Length: 2", "no colon here") + b"ok"),
    ("space-before-colon", head(H, "Content-Length : 2") + b"ok"),
    ("tab-before-colon", head(H, "Content-Length\t: 2") + b"ok"),
    ("obs-fold", head(H, "Content-Length: 2", " folded continuation") + b"ok"),
    ("obs-fold-tab", head(H, "X-A: 1", "\tfolded", "Content-Length: 2") + b"ok"),
    ("empty-name", head(H, ": empty name", "Content-Length: 2") + b"ok"),
    ("nbsp-in-name", head(H, b"X\xa0Y: 1", "Content-Length: 2") + b"ok"),
    ("nul-in-value", head(H, b"X-A: a\x00b", "Content-Length: 2") + b"ok"),
    ("ctl-in-value", head(H, b"X-A: a\x01b", "Content-Length: 2") + b"ok"),
    ("del-in-value", head(H, b"X-A: a\x7fb", "Content-Length: 2") + b"ok"),
    ("cr-in-value", head(H, b"X-A: a\rb", "Content-Length: 2") + b"ok"),
    ("bare-lf-header", head(H, b"X-A: a\nContent-Length: 2") + b"ok"),
    ("cr-cr-lf-header", head(H, b"X-A: a\r", "Content-Length: 2") + b"ok"),
    # --- Content-Length values ---
    ("cl-nbsp", _cl(b"\xa05")),
    ("cl-nbsp-after", _cl(b"5\xa0")),
    ("cl-nel", _cl(b"5\x85")),
    ("cl-list-same", _cl(b"5, 5")),
    ("cl-list-different", _cl(b"5, 6")),
    ("cl-two-same", head(H, "Content-Length: 5", "Content-Length: 5") + b"hello"),
    ("cl-two-different", head(H, "Content-Length: 5", "Content-Length: 6") + b"hello!"),
    ("cl-negative", _cl(b"-5")),
    ("cl-plus", _cl(b"+5")),
    ("cl-word", _cl(b"five")),
    ("cl-empty-value", _cl(b"")),
    ("cl-16-digits", _cl(b"1234567890123456")),
    ("cl-overflow", _cl(b"99999999999999999999999")),
    ("cl-hex", _cl(b"0x5")),
    ("cl-two-numbers", _cl(b"5 5")),
    ("cl-superscript-two", _cl("\xb2".encode("latin-1"))),
    ("cl-arabic-digit", _cl("\u0665".encode())),
    ("cl-underscore", _cl(b"0_5")),
    ("cl-longer-than-body", _cl(b"5000", b"x" * 4000)),
    ("cl-zero-with-bytes", _cl(b"0", b"hello")),
    # --- Transfer-Encoding values ---
    ("te-nbsp", _te(b"chunked\xa0")),
    ("te-nbsp-before", _te(b"\xa0chunked")),
    ("te-nel", _te(b"chunked\x85")),
    ("te-gzip", _te(b"gzip", b"hello")),
    ("te-gzip-chunked", _te(b"gzip, chunked")),
    ("te-chunked-chunked", _te(b"chunked, chunked")),
    ("te-chunked-twice", head(H, TE, TE) + chunked(b"hello")),
    ("te-chunked-then-gzip", head(H, TE, "Transfer-Encoding: gzip") + chunked(b"hello")),
    ("te-identity", _te(b"identity", b"hello")),
    ("te-uppercase", _te(b"CHUNKED")),
    ("te-spaces", _te(b"  chunked  ")),
    ("te-leading-comma", _te(b", chunked")),
    ("te-trailing-comma", _te(b"chunked,")),
    ("te-parameter", _te(b"chunked;q=1")),
    ("te-empty", _te(b"", b"hello")),
    ("te-and-cl", head(H, "Content-Length: 3", TE) + chunked(b"hello", b"!")),
    ("cl-and-te", head(H, TE, "Content-Length: 3") + chunked(b"hello", b"!")),
    # --- chunk framing ---
    ("chunk-size-cr-cr-lf", _chunks(b"5\r\r\nhello\r\n0\r\n\r\n")),
    ("chunk-size-bare-lf", _chunks(b"5\nhello\r\n0\r\n\r\n")),
    ("chunk-size-bare-cr", _chunks(b"5\rhello\r\n0\r\n\r\n")),
    ("last-chunk-bare-lf", _chunks(b"5\r\nhello\r\n0\n\r\n")),
    ("final-crlf-bare-lf", _chunks(b"5\r\nhello\r\n0\r\n\n")),
    ("chunk-data-bare-lf", _chunks(b"5\r\nhello\n0\r\n\r\n")),
    ("chunk-ext-nul", _chunks(b"5;a\x00b\r\nhello\r\n0\r\n\r\n")),
    ("chunk-ext-value-nul", _chunks(b"5;a=b\x00c\r\nhello\r\n0\r\n\r\n")),
    ("chunk-ext-cr", _chunks(b"5;a\rb\r\nhello\r\n0\r\n\r\n")),
    ("chunk-ext-space-before", _chunks(b"5 ;a=b\r\nhello\r\n0\r\n\r\n")),
    ("chunk-ext-space-after", _chunks(b"5; a=b\r\nhello\r\n0\r\n\r\n")),
    ("chunk-ext-quoted-crlf", _chunks(b"5;a=\"x\r\ny\"\r\nhello\r\n0\r\n\r\n")),
    ("chunk-size-space-after", _chunks(b"5 \r\nhello\r\n0\r\n\r\n")),
    ("chunk-size-tab-after", _chunks(b"5\t\r\nhello\r\n0\r\n\r\n")),
    ("chunk-size-space-before", _chunks(b" 5\r\nhello\r\n0\r\n\r\n")),
    ("chunk-size-leading-zeros", _chunks(b"0005\r\nhello\r\n0000\r\n\r\n")),
    ("chunk-size-not-hex", _chunks(b"zz\r\nhello\r\n0\r\n\r\n")),
    ("chunk-size-negative", _chunks(b"-5\r\nhello\r\n0\r\n\r\n")),
    ("chunk-size-0x", _chunks(b"0x5\r\nhello\r\n0\r\n\r\n")),
    ("chunk-size-plus", _chunks(b"+5\r\nhello\r\n0\r\n\r\n")),
    ("chunk-size-empty", _chunks(b"\r\nhello\r\n0\r\n\r\n")),
    ("chunk-size-two-numbers", _chunks(b"5 5\r\nhello\r\n0\r\n\r\n")),
    ("chunk-size-17-digits", _chunks(b"1234567890abcdef0\r\nhello\r\n0\r\n\r\n")),
    ("chunk-size-overflow", _chunks(b"fffffffffffffffff\r\nhello\r\n0\r\n\r\n")),
    ("chunk-size-huge-then-bytes", _chunks(b"FFFFFFFFFFFFFFF\r\n" + BIG)),
    ("chunk-longer-than-said", _chunks(b"5\r\nhelloXX\r\n0\r\n\r\n")),
    ("chunk-no-crlf", _chunks(b"5\r\nhello0\r\n\r\n")),
    ("chunk-junk-before-lf", _chunks(b"5\r\nhelloX\n0\r\n\r\n")),
    ("cut-mid-chunk", _chunks(b"400\r\n" + b"x" * 100)),
    ("cut-between-chunks", _chunks(b"5\r\nhello\r\n")),
    ("cut-before-final-crlf", _chunks(b"5\r\nhello\r\n0\r\n")),
    ("cut-in-size-line", _chunks(b"5\r\nhello\r\n1")),
    ("no-final-chunk", _chunks(b"5\r\nhello\r\n")),
    ("cut-in-trailers", _chunks(b"5\r\nhello\r\n0\r\nX-T: 1\r\n")),
    ("trailer-obs-fold", _chunks(b"5\r\nhello\r\n0\r\nX-T: 1\r\n folded\r\n\r\n")),
    ("trailer-no-colon", _chunks(b"5\r\nhello\r\n0\r\nnot a field\r\n\r\n")),
    ("trailer-bare-lf", _chunks(b"5\r\nhello\r\n0\r\nX-T: 1\n\r\n")),
    ("129-trailers", _chunks(chunked(b"hello", trailers=b"".join(b"X-T%d: v\r\n" % i for i in range(129))))),
    # --- interim (1xx) responses ---
    ("100-then-200", _interim(1)),
    ("103-with-link", head("HTTP/1.1 103 Early Hints", "Link: </a.css>; rel=preload") + ok(b"final")),
    ("8-interim", _interim(8)),
    ("9-interim-flood", _interim(9)),
    ("100-flood", _interim(100)),
    ("http1.0-100-then-200", head("HTTP/1.0 100 Continue") + ok(b"final")),
    ("100-with-close", head("HTTP/1.1 100 Continue", "Connection: close") + ok(b"final")),
    ("199-with-length", head("HTTP/1.1 199 Odd", "Content-Length: 2") + b"ab" + ok(b"final")),
    ("100-with-chunked", head("HTTP/1.1 100 Continue", TE) + b"0\r\n\r\n" + ok(b"final")),
    ("100-only", _interim(1)[:-len(ok(b"final"))]),
    ("101-after-100", head("HTTP/1.1 100 Continue") + b"HTTP/1.1 101 Switching\r\n\r\n"),
    # --- Content-Encoding: decoded by the client, by the standard library for the oracle ---
    ("gzip", ok(gzip.compress(IMAGE), GZ)),
    ("gzip-chunked", head(H, TE, GZ) + chunked(gzip.compress(IMAGE))),
    ("gzip-two-members", ok(gzip.compress(IMAGE[:1000]) + gzip.compress(IMAGE[1000:]), GZ)),
    ("gzip-two-members-chunked", head(H, TE, GZ) + chunked(gzip.compress(IMAGE[:1000]), gzip.compress(IMAGE[1000:]))),
    ("gzip-three-members-one-empty", ok(gzip.compress(b"a") + gzip.compress(b"") + gzip.compress(b"b"), GZ)),
    ("gzip-trailing-garbage", ok(gzip.compress(IMAGE) + b"trailing garbage", GZ)),
    ("gzip-trailing-one-byte", ok(gzip.compress(IMAGE) + b"\x1f", GZ)),
    ("gzip-trailing-zeros", ok(gzip.compress(IMAGE) + b"\0" * 8, GZ)),
    ("gzip-cut-second-member", ok(gzip.compress(IMAGE) + gzip.compress(b"more")[:-3], GZ)),
    ("gzip-truncated", ok(gzip.compress(IMAGE)[:-10], GZ)),
    ("gzip-not-gzip", ok(b"this is not gzip at all", GZ)),
    ("gzip-bomb", ok(gzip.compress(b"\0" * (8 << 20)), GZ)),
    ("x-gzip", ok(gzip.compress(IMAGE), "Content-Encoding: x-gzip")),
    ("deflate-zlib", ok(zlib.compress(IMAGE), DEFLATE)),
    ("deflate-raw", ok(zlib.compress(IMAGE)[2:-4], DEFLATE)),
    ("deflate-trailing-garbage", ok(zlib.compress(IMAGE) + b"x", DEFLATE)),
    ("deflate-raw-trailing-garbage", ok(zlib.compress(IMAGE)[2:-4] + b"xyz", DEFLATE)),
    ("deflate-two-streams", ok(zlib.compress(IMAGE) + zlib.compress(IMAGE), DEFLATE)),
    ("deflate-truncated", ok(zlib.compress(IMAGE)[:-10], DEFLATE)),
]


# --- the oracle ----------------------------------------------------------------
class _Reference:
    """A plain llhttp parser's reading: the final (non-1xx) response's headers and body."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.head_done = self.final_head = self.final_done = False

    def on_message_begin(self) -> None:
        if not self.final_done:
            self.headers, self.body, self.head_done, self.final_head = [], b"", False, False

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.head_done:
            self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.head_done = True
        self.final_head = not 100 <= self.parser.get_status_code() < 200

    def on_body(self, data: bytes) -> None:
        if not self.final_done:
            self.body += data

    def on_message_complete(self) -> None:
        self.final_done = self.final_head

    def until_close(self) -> bool:
        """Whether llhttp would end this body at the end of the stream (``llhttp_finish``,
        which httptools does not expose): no length, and no chunked as the last coding."""
        names = [name for name, _ in self.headers]
        codings = [value for name, value in self.headers if name == b"transfer-encoding"]
        chunked = bool(codings) and codings[-1].split(b",")[-1].strip(b" \t").lower() == b"chunked"
        return self.final_head and b"content-length" not in names and not chunked


def llhttp_body(data: bytes) -> bytes | None:
    """The body llhttp delivers for ``data`` followed by the end of the stream; None if it
    refuses the response. What follows a complete response is another response's business."""
    reference = _Reference()
    try:
        reference.parser.feed_data(data)
    except (httptools.HttpParserError, httptools.HttpParserUpgrade):
        return reference.body if reference.final_done else None
    if reference.final_done or reference.until_close():
        return _content_decoded(reference.body, dict(reference.headers).get(b"content-encoding", b""))
    return None


def _content_decoded(body: bytes, encoding: bytes) -> bytes | None:
    """The body as the standard library decodes it (None if it cannot): ``gzip.decompress``
    reads every member; a deflate stream must end where the body does."""
    encoding = encoding.strip(b" \t").lower()
    try:
        if encoding in (b"gzip", b"x-gzip"):
            return gzip.decompress(body)
        if encoding == b"deflate":
            for wbits in (zlib.MAX_WBITS, -zlib.MAX_WBITS):
                decoder = zlib.decompressobj(wbits)
                try:
                    out = decoder.decompress(body)
                except zlib.error:
                    continue
                return out if decoder.eof and not decoder.unused_data else None
            return None
    except (OSError, EOFError, zlib.error):
        return None
    return body


# --- the test --------------------------------------------------------------------
def test_the_corpus_is_large_and_named_once():
    names = [name for name, _ in CORPUS]
    assert len(names) >= 100 and len(set(names)) == len(names)


@pytest.mark.parametrize("answer", [answer for _, answer in CORPUS], ids=[name for name, _ in CORPUS])
async def test_the_client_is_never_more_lenient_than_llhttp(serve, client, answer):
    expected = llhttp_body(answer)
    server = await serve(respond(answer, close=True))
    try:
        _response, body = await fetch(client, server.url())
    except (BadResponse, Disconnected, BodyTooLarge):
        return  # refusing is always allowed: the client's policy is stricter than llhttp
    assert expected is not None, f"llhttp refuses it, the client took {body[:60]!r}"
    assert body == expected
