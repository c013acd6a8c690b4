"""A host's addresses kept for its next connections: one lookup a host, failures not kept."""
from __future__ import annotations

import asyncio
import socket

import pytest

from common.statuses import Status
from worker.fetching.address_cache import AddressCache
from worker.politeness import Refused


class Resolver:
    """Answers from a table, counting lookups; ``gate`` holds every lookup until set."""

    def __init__(self, answers: dict[str, list[str]]):
        self.answers = answers
        self.lookups: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def lookup(self, host: str, port: int) -> list[str]:
        self.lookups.append(host)
        await self.gate.wait()
        answer = self.answers[host]
        if isinstance(answer, BaseException):
            raise answer
        return list(answer)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("later, lookups", [(0.0, 1), (9.9, 1), (10.0, 2), (60.0, 2)])
async def test_an_answer_is_kept_ten_seconds(later: float, lookups: int) -> None:
    resolver, clock = Resolver({"a.test": ["192.0.2.7"]}), Clock()
    cache = AddressCache(resolver.lookup, clock, seconds=10.0)
    assert await cache.addresses("a.test", 443) == ["192.0.2.7"]
    clock.now += later
    assert await cache.addresses("a.test", 443) == ["192.0.2.7"]
    assert len(resolver.lookups) == lookups


async def test_hosts_and_ports_are_kept_apart() -> None:
    resolver = Resolver({"a.test": ["192.0.2.7"], "b.test": ["192.0.2.8"]})
    cache = AddressCache(resolver.lookup, Clock())
    for host, port in [("a.test", 80), ("a.test", 443), ("b.test", 80), ("a.test", 80)]:
        await cache.addresses(host, port)
    assert resolver.lookups == ["a.test", "a.test", "b.test"]


async def test_connections_opened_together_share_one_lookup() -> None:
    resolver = Resolver({"a.test": ["192.0.2.7"]})
    resolver.gate.clear()
    cache = AddressCache(resolver.lookup, Clock())
    waiting = [asyncio.ensure_future(cache.addresses("a.test", 443)) for _ in range(8)]
    await asyncio.sleep(0)
    resolver.gate.set()
    assert await asyncio.gather(*waiting) == [["192.0.2.7"]] * 8
    assert resolver.lookups == ["a.test"]


@pytest.mark.parametrize("failure", [socket.gaierror(socket.EAI_NONAME, "unknown"),
                                     Refused(Status.FORBIDDEN_ADDRESS, "a.test resolves only to forbidden addresses")])
async def test_a_failure_reaches_every_waiter_and_is_not_kept(failure: BaseException) -> None:
    resolver = Resolver({"a.test": failure})
    resolver.gate.clear()
    cache = AddressCache(resolver.lookup, Clock())
    waiting = [asyncio.ensure_future(cache.addresses("a.test", 443)) for _ in range(3)]
    await asyncio.sleep(0)
    resolver.gate.set()
    answers = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(type(answer) is type(failure) for answer in answers)
    resolver.answers["a.test"] = ["192.0.2.7"]
    assert await cache.addresses("a.test", 443) == ["192.0.2.7"]
    assert resolver.lookups == ["a.test", "a.test"]


async def test_a_waiter_that_times_out_leaves_the_lookup_to_the_others() -> None:
    resolver = Resolver({"a.test": ["192.0.2.7"]})
    resolver.gate.clear()
    cache = AddressCache(resolver.lookup, Clock())
    impatient = asyncio.ensure_future(asyncio.wait_for(cache.addresses("a.test", 443), 0.01))
    patient = asyncio.ensure_future(cache.addresses("a.test", 443))
    with pytest.raises(TimeoutError):
        await impatient
    resolver.gate.set()
    assert await patient == ["192.0.2.7"]
    assert await cache.addresses("a.test", 443) == ["192.0.2.7"]
    assert resolver.lookups == ["a.test"]
