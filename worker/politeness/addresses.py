"""The SSRF guard: the crawler fetches URLs strangers sent it, so it must not
be turned against the network it runs in (cloud metadata at 169.254.169.254,
admin consoles on 10.x, services on localhost).

Two layers, because a hostname may resolve differently on each lookup (DNS
rebinding): ``AddressGuard.check`` refuses a URL early, before a token is
spent, and ``GuardedResolver`` drops forbidden addresses inside aiohttp at
connect time, so the address connected to is always one that was checked.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from typing import Awaitable, Callable
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from common.statuses import Status
from worker.politeness import Refused
from worker.politeness.ttl_cache import TtlCache

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolve = Callable[[str, int], Awaitable[list[str]]]

_NAT64 = ipaddress.ip_network("64:ff9b::/96")
GUARD_CACHE_SECONDS = 30.0  # a verdict per host, so each URL does not cost a lookup


def embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (mapped, NAT64, 6to4), if any."""
    if isinstance(ip, ipaddress.IPv4Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return ip.sixtofour


def is_forbidden(address: str | IPAddress) -> bool:
    """True for anything that is not a public unicast address."""
    ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        return True  # scoped (fe80::1%eth0) is link-local by construction
    inner = embedded_ipv4(ip)
    if inner is not None:
        return is_forbidden(inner)
    return (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
            or ip.is_reserved or ip.is_unspecified or not ip.is_global)


async def system_resolve(host: str, port: int) -> list[str]:
    """Addresses for host via the loop's executor, so the event loop never blocks."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


class AddressGuard:
    """Refuses a URL whose host resolves to any forbidden address."""

    def __init__(self, enabled: bool = True, resolve: Resolve = system_resolve,
                 clock: Callable[[], float] = time.monotonic):
        self.enabled = enabled
        self._resolve = resolve
        self._verdicts: TtlCache[tuple[str, int], str] = TtlCache(clock)

    async def check(self, url: str) -> None:
        """Raise Refused(ForbiddenAddress); a failed lookup passes (the fetch fails on its own)."""
        if not self.enabled:
            return
        parts = urlsplit(url)
        host = (parts.hostname or "").rstrip(".")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        verdict = self._verdicts.get((host, port))
        if verdict is None:
            verdict = await self._first_forbidden(host, port) or ""
            self._verdicts.put((host, port), verdict, GUARD_CACHE_SECONDS)
        if verdict:
            raise Refused(Status.FORBIDDEN_ADDRESS, f"{host} -> {verdict}")

    async def _first_forbidden(self, host: str, port: int) -> str | None:
        try:
            addresses = [str(ipaddress.ip_address(host))]
        except ValueError:
            try:
                addresses = await self._resolve(host, port)
            except OSError:
                return None
        return next((a for a in addresses if is_forbidden(a.split("%")[0])), None)


class GuardedResolver(AbstractResolver):
    """aiohttp resolver that never hands a forbidden address to the connector.

    aiohttp skips the resolver for IP-literal hosts; those cannot rebind and
    are refused by AddressGuard.check before the request. It raises Refused
    rather than an OSError, which aiohttp passes through unwrapped, so the
    fetcher reports a rebinding host as ForbiddenAddress, not a network error.
    """

    def __init__(self, inner: AbstractResolver | None = None):
        self._inner = inner or aiohttp.ThreadedResolver()

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        allowed = [r for r in results if not is_forbidden(r["host"].split("%")[0])]
        if not allowed:
            raise Refused(Status.FORBIDDEN_ADDRESS, f"{host} resolves only to forbidden addresses")
        return allowed

    async def close(self) -> None:
        await self._inner.close()


def build_connector(settings, **kwargs) -> aiohttp.TCPConnector:
    """The worker's connector: guarded resolution unless private networks are allowed.

    Call inside a running event loop; extra kwargs go to TCPConnector.
    """
    if not settings.crawl_allow_private_networks:
        kwargs.setdefault("resolver", GuardedResolver())
    return aiohttp.TCPConnector(**kwargs)
