"""The SSRF guard: the crawler fetches URLs strangers sent it, so it must not
be turned against the network it runs in (cloud metadata at 169.254.169.254,
admin consoles on 10.x, services on localhost).

Two layers, because a hostname may resolve differently on each lookup (DNS
rebinding): ``AddressGuard.check`` refuses a URL early, before a token is
spent, and at connect time every address (IP literals too) is vetted again by
``GuardedResolver``, the resolver of the client that fetches images and
robots.txt, so the address connected to is always one that was checked.
Both layers read the host through ``common.hosts.url_origin``, the reading
the client connects to, so they cannot judge one host and connect to another.

Only clearly public unicast addresses are allowed: ``is_global`` and not in
``NOT_PUBLIC``, so ranges reserved later stay refused until judged.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Awaitable, Callable, Sequence

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from common.hosts import url_origin
from common.statuses import Status
from worker.politeness import Refused
from worker.politeness.ttl_cache import TtlCache

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolve = Callable[[str, int], Awaitable[list[str]]]

_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # DNS64 answers on IPv6-only networks: judge the IPv4 inside
GUARD_CACHE_SECONDS = 30.0  # a verdict per host, so each URL does not cost a lookup

# Ranges Python 3.11's is_global calls global (or that carry another address the
# socket would reach in disguise), none of which a public image lives at.
NOT_PUBLIC = tuple(ipaddress.ip_network(net) for net in (
    "0.0.0.0/8", "100.64.0.0/10", "192.0.0.0/24", "192.88.99.0/24", "198.18.0.0/15",
    "224.0.0.0/4", "240.0.0.0/4",
    "::/96",            # IPv4-compatible, deprecated
    "64:ff9b:1::/48",   # local-use IPv4/IPv6 translation
    "2001::/32",        # Teredo: the client address inside is obfuscated
    "2001:db8::/32", "3fff::/20",  # documentation
    "2002::/16",        # 6to4: an IPv4 address inside, relayed
    "fec0::/10",        # site-local, deprecated but still routed on some networks
    "ff00::/8",         # multicast
))


def embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv4-mapped or NAT64 address reaches, if any."""
    if isinstance(ip, ipaddress.IPv4Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_forbidden(address: str | IPAddress) -> bool:
    """True for anything that is not clearly a public unicast address."""
    try:
        ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    except ValueError:
        return True  # e.g. fe80::1%eth0 from a resolver: scoped is link-local by construction
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        return True
    inner = embedded_ipv4(ip)
    if inner is not None:
        return is_forbidden(inner)
    return not ip.is_global or ip.is_reserved or any(ip in net for net in NOT_PUBLIC)


def allowed_results(host: str, results: Sequence[ResolveResult]) -> list[ResolveResult]:
    """The results whose address may be connected to; Refused if none may.

    Refused rather than an OSError, which the image client reports as ConnectFailed, so the
    fetcher reports a rebinding host as ForbiddenAddress, not a network error."""
    allowed = [r for r in results if not is_forbidden(r["host"])]
    if not allowed:
        raise Refused(Status.FORBIDDEN_ADDRESS, f"{host} resolves only to forbidden addresses")
    return allowed


async def system_resolve(host: str, port: int) -> list[str]:
    """Addresses for host via the loop's executor, so the event loop never blocks."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class AddressGuard:
    """Refuses a URL whose host resolves to any forbidden address."""

    def __init__(self, enabled: bool = True, resolve: Resolve = system_resolve,
                 clock: Callable[[], float] = time.monotonic):
        self.enabled = enabled
        self._resolve = resolve
        self._verdicts: TtlCache[tuple[str, int], str] = TtlCache(clock)

    async def check(self, url: str) -> None:
        """Raise Refused(ForbiddenAddress), or InvalidHost (a ValueError) for a host that does
        not normalise. A failed lookup passes and is not remembered: the client connects to
        the same normalised host through a guarded resolver, so it fails there as a connect
        error, or is vetted there if the name has come to resolve."""
        if not self.enabled:
            return
        _scheme, host, port = url_origin(url)
        verdict = self._verdicts.get((host, port))
        if verdict is None:
            try:
                addresses = _literal(host) or await self._resolve(host, port)
            except OSError:
                return
            verdict = next((a for a in addresses if is_forbidden(a)), "")
            self._verdicts.put((host, port), verdict, GUARD_CACHE_SECONDS)
        if verdict:
            raise Refused(Status.FORBIDDEN_ADDRESS, f"{host} -> {verdict}")


def _literal(host: str) -> list[str]:
    """[host] if the (normalised) host is an IP address, which needs no lookup."""
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        return []


class GuardedResolver(AbstractResolver):
    """Resolver that never hands a forbidden address to the image client (which resolves
    IP literals through it too)."""

    def __init__(self, inner: AbstractResolver | None = None):
        self._inner = inner or aiohttp.ThreadedResolver()

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        return allowed_results(host, await self._inner.resolve(host, port, family))

    async def close(self) -> None:
        await self._inner.close()
