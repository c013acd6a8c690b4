"""What a fetch must ask before and after touching a website (SPEC.md §3).

The worker's fetcher (``worker/fetching/fetch.py``) calls a ``RequestGate`` for every
hop of a request, the first URL and each redirect target, in this order:

1. ``await gate.before_request(url, source)``: may raise ``Refused``
   (``ForbiddenAddress``; ``RobotsDisallowed`` or ``OptedOut`` with the
   site's ``decision``: robots.txt, its Content-Usage rules, tdmrep.json;
   ``RobotsUnavailable`` or ``TdmRepUnavailable`` with a ``retry_at``: the
   URL must wait, not end) before any token is spent; waits while the
   host's robots.txt and tdmrep.json are fetched by whichever worker got
   there first.
2. ``async with gate.host_slot(url):`` the per-host concurrency cap and the
   Crawl-delay turn.
3. inside the slot the fetcher takes a ``currtokens:{source}`` token and
   sends at once (a token taken before a wait for the slot would reach the
   site in a burst with later ones).
4. ``await gate.after_response(url, source, status, headers)``: Retry-After
   on 429/503 pauses the source for the whole cluster.
"""
from __future__ import annotations

from contextlib import AbstractAsyncContextManager as AsyncContextManager
from typing import Any, Protocol
from collections.abc import Mapping


class Refused(Exception):
    """A URL this crawler must not request; ``reason`` is its status (and crawl_errors reason).
    ``retry_at`` (Unix time): the refusal is for now only, ask again from then. ``decision``:
    the site's opt-out (``worker.politeness.consent.Decision``): the URL ends in opted_out."""

    def __init__(self, reason: str, detail: str = "", retry_at: float | None = None,
                 decision: Any = None):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.retry_at = retry_at
        self.decision = decision


class RequestGate(Protocol):
    async def before_request(self, url: str, source: str) -> None: ...

    def host_slot(self, url: str) -> AsyncContextManager[None]: ...

    async def after_response(self, url: str, source: str, status: int,
                             headers: Mapping[str, str]) -> None: ...
