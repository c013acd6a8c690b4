"""The SSRF guard's decisions, with injected resolvers: nothing here connects anywhere."""
from __future__ import annotations

import socket

import pytest
from aiohttp.abc import AbstractResolver

from test.sites import Site
from worker.politeness import Refused
from worker.fetching.http_client import HttpClient
from worker.politeness.addresses import AddressGuard, GuardedResolver, is_forbidden

pytestmark = pytest.mark.paced  # runs by itself, after the rest (pytest.ini)

FORBIDDEN = [
    "127.0.0.1", "127.8.9.10", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254",
    "100.64.0.1", "0.0.0.0", "224.0.0.1", "240.0.0.1", "255.255.255.255", "192.0.2.1",
    "::1", "::", "fe80::1", "fe80::1%2", "fc00::1", "fd12:3456::1", "ff02::1",
    "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:10.0.0.1",
    "64:ff9b::a9fe:a9fe", "64:ff9b::7f00:1", "2002:7f00:1::1", "2002:a00:1::",
    "2001:db8::1", "2002:808:808::1",  # 6to4 is refused whatever it carries
    # is_global says yes to these on Python 3.11: NOT_PUBLIC says no
    "fec0::1", "3fff::1", "192.0.0.9", "ff0e::1", "64:ff9b:1::1", "::127.0.0.1", "::8.8.8.8",
    "5f00::1", "2001:0:4136:e378:8000:63bf:3fff:fdd2", "192.88.99.1",
]
PUBLIC = ["8.8.8.8", "93.184.216.34", "1.1.1.1", "2606:4700:4700::1111", "2a00:1450:4001::1",
          "::ffff:8.8.8.8", "64:ff9b::808:808"]


@pytest.mark.parametrize("address", FORBIDDEN)
def test_forbidden_addresses(address):
    assert is_forbidden(address)


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses(address):
    assert not is_forbidden(address)


def resolver(table: dict[str, list[str]]):
    calls = []

    async def resolve(host: str, port: int) -> list[str]:
        calls.append(host)
        if host not in table:
            raise socket.gaierror("no such host")
        return table[host]
    return resolve, calls


@pytest.mark.parametrize("url", [
    "http://127.0.0.1/x", "http://[::1]:8080/", "https://169.254.169.254/latest/meta-data",
    "http://[::ffff:a9fe:a9fe]/", "http://internal.example/", "http://mixed.example/",
])
async def test_guard_refuses(url):
    resolve, _ = resolver({"internal.example": ["10.0.0.5"],
                           "mixed.example": ["93.184.216.34", "192.168.0.1"]})
    with pytest.raises(Refused) as refused:
        await AddressGuard(resolve=resolve).check(url)
    assert refused.value.reason == "ForbiddenAddress"


async def test_guard_allows_public_and_unresolvable_hosts_and_caches_verdicts():
    resolve, calls = resolver({"images.example": ["93.184.216.34", "2606:4700::1"]})
    guard = AddressGuard(resolve=resolve)
    for _ in range(3):
        await guard.check("https://images.example/a.jpg")
    await guard.check("http://8.8.8.8/a.jpg")  # a literal needs no lookup
    await guard.check("http://nxdomain.example/")  # fails on its own when fetched
    assert calls == ["images.example", "nxdomain.example"]


@pytest.mark.parametrize("url", ["http://2130706433/", "http://0x7f.1/", "http://127.1/",
                                 "http://localhost./"])
async def test_guard_sees_through_numeric_forms_with_the_system_resolver(url):
    with pytest.raises(Refused, match="ForbiddenAddress"):
        await AddressGuard().check(url)  # getaddrinfo answers these locally


async def test_guard_off_for_private_networks():
    resolve, calls = resolver({})
    await AddressGuard(enabled=False, resolve=resolve).check("http://127.0.0.1/")
    assert calls == []


class FakeResolver(AbstractResolver):
    def __init__(self, addresses: list[str]):
        self.addresses = addresses

    async def resolve(self, host, port=0, family=socket.AF_INET):
        return [{"hostname": host, "host": a, "port": port, "family": family, "proto": 0,
                 "flags": socket.AI_NUMERICHOST} for a in self.addresses]

    async def close(self):
        pass


async def test_guarded_resolver_drops_forbidden_addresses():
    mixed = GuardedResolver(FakeResolver(["169.254.169.254", "93.184.216.34"]))
    assert [r["host"] for r in await mixed.resolve("rebind.example", 80)] == ["93.184.216.34"]
    with pytest.raises(Refused, match="ForbiddenAddress"):
        await GuardedResolver(FakeResolver(["127.0.0.1", "::1"])).resolve("rebind.example", 80)


async def test_the_guarded_client_never_connects_to_loopback():
    async with Site() as site:
        port = site.url.rsplit(":", 1)[1]
        guarded = HttpClient("test", resolver=GuardedResolver())
        try:
            with pytest.raises(Refused, match="ForbiddenAddress"):  # what the fetcher reports
                await guarded.connect(f"http://localhost:{port}/")
            with pytest.raises(Refused, match="ForbiddenAddress"):  # IP literals go through the resolver too
                await guarded.connect(f"http://127.0.0.1:{port}/")
        finally:
            await guarded.close()
        unguarded = HttpClient("test")  # CRAWL_ALLOW_PRIVATE_NETWORKS: the system's resolver
        try:
            async with unguarded.get(f"http://localhost:{port}/") as response:
                assert response.status == 200
        finally:
            await unguarded.close()
    assert site.paths() == ["/"]
