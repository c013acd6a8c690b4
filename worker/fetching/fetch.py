"""One polite, bounded download: the rate-limited session of SPEC.md §3.

Every hop (the first URL and each redirect target) is a request of its own:
it asks the ``RequestGate`` first (robots.txt, address checks), waits for
its host slot, has its connection ready (kept alive, or opened now) and
only then takes a token (which counts it in ``num_requests:{source}``), so
that it is written the moment its token is spent: tokens held while
queueing for a busy host or a handshake would reach the site in bursts. A
connect that fails costs a token all the same (its SYNs reached the site).
Redirects are followed here rather than by aiohttp for exactly that
reason. The body is received into shared memory (``worker.fetching.http_client``)
and abandoned past the size cap, so a hostile server cannot make us hold
more than ``max_image_bytes``.

Whatever goes wrong comes out as one ``FetchError`` whose ``status`` is the
name recorded in Redis (``Timeout``, ``TooLarge``, ``RobotsDisallowed``...).
"""
from __future__ import annotations

import asyncio
import ssl
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from collections.abc import Mapping
from urllib.parse import urljoin

from redis.exceptions import RedisError

from common.contracts import EVENT_FETCH_UNEXPECTED_ERROR
from common.contracts import InvalidMessage, validate_url
from common.jsonlog import log_event
from common.statuses import Status
from worker import metrics
from worker.constants import MAX_REDIRECTS, REDIRECT_STATUSES, TOTAL_TIMEOUT
from worker.fetching.http_client import (BadResponse, BodyTooLarge, ConnectFailed, Disconnected, HttpClient, Ready,
                                         TooLate)
from worker.politeness import Refused, RequestGate
from worker.politeness.consent import Decision, ResponseConsent
from worker.fetching.shared_memory import Body, SegmentPool, SegmentUnavailable
from worker.fetching.tokens import ShuttingDown, SourceHalted, TokenBuckets


@dataclass(frozen=True)
class Fetched:
    url: str                      # after redirects
    status: int
    headers: Mapping[str, str]    # a CIMultiDict: X-Robots-Tag may repeat
    body: Body                    # read for 2xx only; its holder releases it
    token_wait: float             # seconds spent waiting for tokens
    ttfb: float = 0.0             # the last hop's time to first byte (worker.fetching.http_client)

    @property
    def size(self) -> int:
        return self.body.size


class FetchError(Exception):
    def __init__(self, status: str, http_status: int | None = None, token_wait: float = 0.0,
                 retry_at: float | None = None, decision: Decision | None = None):
        super().__init__(status)
        self.status = status              # the Redis status name, also the crawl_errors reason
        self.http_status = http_status    # crawl_errors "status"
        self.token_wait = token_wait
        self.retry_at = retry_at          # a refusal for now only (RobotsUnavailable): ask again then
        self.decision = decision          # the site opted out: the signal and value (opted_out)


class Fetcher:
    def __init__(self, client: HttpClient, gate: RequestGate, tokens: TokenBuckets, max_bytes: int,
                 total_timeout: float = TOTAL_TIMEOUT, body_budget: int | None = None,
                 consent: ResponseConsent | None = None):
        """``body_budget``: bytes the bodies in hand (being received or waiting for the image
        pool) may hold before a new download waits; None: no budget. ``consent``: the judge of a
        2xx response's head; an opt-out there ends the fetch before the body is read."""
        self._client = client
        self._gate = gate
        self._tokens = tokens
        self._max_bytes = max_bytes
        self._segments = SegmentPool(max_bytes + 1)  # one byte more shows a body over the cap
        self._total_timeout = total_timeout
        self._body_budget = body_budget
        self._consent = consent

    async def fetch(self, url: str, source: str) -> Fetched:
        waited = 0.0
        if self._body_budget is not None:  # before a token is spent: waiting is not an outcome
            await self._segments.wait_for_room(self._body_budget)
        try:
            for _hop in range(MAX_REDIRECTS + 1):
                await self._gate.before_request(url, source)
                while True:
                    hop_wait, slot, ready = await self._slot_and_token(url, source)
                    waited += hop_wait
                    async with slot:
                        try:
                            status, headers, body, ttfb = await self._request(url, source, ready)
                            break
                        except TooLate as late:  # nothing sent: the token is forfeited, another taken
                            await self._tokens.forfeit(source, late.late_by)
                location = headers.get("Location") if status in REDIRECT_STATUSES else None
                if not location:
                    return Fetched(url, status, headers, body, waited, ttfb)
                url = _redirect_target(url, location)
            raise FetchError(Status.TOO_MANY_REDIRECTS, status)
        except FetchError as exc:
            exc.token_wait = waited
            raise
        except (ShuttingDown, SourceHalted, RedisError, SegmentUnavailable, asyncio.CancelledError):
            raise  # not the site's doing: Redis and memory are our infrastructure, waited out by the task
        except Exception as exc:
            raise _classify(exc, waited) from exc

    def body_bytes_held(self) -> int:
        """Memory the bodies in hand hold now, against ``body_budget`` (worker.metrics)."""
        return self._segments.held_bytes

    async def _slot_and_token(self, url: str, source: str) -> tuple[float, AsyncExitStack, Ready]:
        """The host slot, entered, and a connection ready, with a token spent last; and the
        seconds waited for tokens. The token comes last so that the request is written the
        moment the token's answer is read: one spent before a connect would reach the site
        late by the connect time, bunched with requests sent on kept-alive connections."""
        waited = 0.0
        failed: Exception | None = None  # a connect that failed still costs a token: SYNs are traffic
        turn = _Turn(self._tokens.turn(source))
        try:
            while True:
                turn_asked = time.monotonic()
                await turn.take()  # never while holding a host slot: its holder may be waiting for one
                # The turn's wait is a wait for the source's tokens (its other tasks hold them), not
                # work: counted as work, a source's latency, and so its slots, grew with its own queue.
                waited += time.monotonic() - turn_asked
                waited += await self._tokens.until_available(source)
                slot = AsyncExitStack()
                await slot.enter_async_context(self._gate.host_slot(url))
                ready = None
                try:
                    ready = self._client.idle(url) if failed is None else None
                    if ready is None and failed is None:
                        # The turn is given up for the handshake, so that it does not hold up the
                        # source's other tasks, and not taken again: the token script is atomic,
                        # the turn only spares Redis the polls of many waiting tasks.
                        turn.give()
                        try:
                            ready = await self._client.connect(url)
                        except Exception as exc:  # noqa: BLE001 - raised below, once its token is spent
                            failed = exc
                    send_by = await self._tokens.take(source)
                    if send_by is not None:
                        if failed is not None:
                            raise failed
                        assert ready is not None
                        return waited, slot, ready._replace(send_by=send_by)
                except BaseException:
                    if ready is not None:
                        ready.connection.close()
                    await slot.aclose()
                    raise
                if ready is not None:
                    self._client.give_back(url, ready)  # another worker took the last token
                await slot.aclose()
        finally:
            turn.give()

    async def _request(self, url: str, source: str, ready: Ready) -> tuple[int, Mapping[str, str], Body, float]:
        started = time.monotonic()  # the request is written at once: ``ready`` holds its connection
        async with asyncio.timeout(self._total_timeout), self._client.get(url, ready) as response:
            metrics.FIRST_BYTE.observe(response.ttfb)
            body = Body()
            try:
                if 200 <= response.status < 300:
                    decision = self._consent.refusal(response.headers) if self._consent else None
                    if decision is not None:
                        # Not a byte of the body is read: the unread response closes the connection
                        # (worker.fetching.http_client), which costs the site less than sending it all.
                        raise FetchError(Status.OPTED_OUT, response.status, decision=decision)
                    body = await response.read_body(self._segments, self._max_bytes)
                    metrics.downloaded(time.monotonic() - started, body.size)
            except BodyTooLarge:
                raise FetchError(Status.TOO_LARGE, response.status) from None
            finally:
                try:
                    await self._gate.after_response(url, source, response.status, response.headers)
                except BaseException:
                    body.release()
                    raise
            return response.status, response.headers, body, response.ttfb


class _Turn:
    """The source's turn to wait for a token (``TokenBuckets.turn``), and whether
    this task holds it, so it can be given up during a connect and never released twice."""

    def __init__(self, lock: asyncio.Lock):
        self._lock = lock
        self._held = False

    async def take(self) -> None:
        if not self._held:
            await self._lock.acquire()
            self._held = True

    def give(self) -> None:
        if self._held:
            self._held = False
            self._lock.release()


def _redirect_target(current: str, location: str) -> str:
    try:
        return validate_url(urljoin(current, _as_sent(location)))
    except (InvalidMessage, ValueError):
        raise FetchError(Status.BAD_REDIRECT) from None


def _as_sent(location: str) -> str:
    """Header values are read as latin-1, byte for byte; a non-ASCII Location is UTF-8 on
    the wire (as browsers read it), so its bytes are read again as such."""
    try:
        return location.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return location  # not UTF-8: left as it came, and judged as such


def _classify(exc: Exception, waited: float) -> FetchError:
    name: str
    if isinstance(exc, Refused):  # the gate's, or the SSRF guard's at connect time
        return FetchError(exc.reason, token_wait=waited, retry_at=exc.retry_at, decision=exc.decision)
    if isinstance(exc, TimeoutError):  # connect, silence or total
        name = Status.TIMEOUT
    elif isinstance(exc, ssl.SSLError):
        name = Status.SSL_ERROR
    elif isinstance(exc, ConnectFailed):
        name = Status.CONNECTION_ERROR
    elif isinstance(exc, (Disconnected, ConnectionError)):
        name = Status.SERVER_DISCONNECTED
    elif isinstance(exc, BadResponse):
        name = Status.BAD_RESPONSE
    elif isinstance(exc, ValueError):  # common.hosts.InvalidHost among them
        name = Status.INVALID_URL
    else:
        log_event(EVENT_FETCH_UNEXPECTED_ERROR, error=repr(exc))
        name = type(exc).__name__
    return FetchError(name, token_wait=waited)
