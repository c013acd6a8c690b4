"""The SSRF guard against every way of writing a forbidden host we could think of.

Each spelling is fetched the way the worker fetches: through the whole fetcher
(address guard, robots.txt, per-host cap, the image client), and through the
connecting layer alone (the image client with its guarded resolver, which
fetches robots.txt too), directly and as the target of a redirect from a
public-looking first hop (for images and for robots.txt).

Nothing leaves this machine: names resolve from ``NAMES`` (or as numeric
literals, ``AI_NUMERICHOST``), and ``loop.sock_connect``, through which every
asyncio TCP connect goes, is intercepted. A
connect to ``PUBLIC_IP`` is diverted to the local test site; any other connect
is recorded and refused, and fails the test: every spelling below names a
forbidden address, so the only address that may ever be connected to is the
public first hop.
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urlsplit

import pytest
from aiohttp.abc import AbstractResolver

from common.contracts import tokens_key
from common.settings import Settings
from test.sites import TEST_USER_AGENT, Page, Site
from test.worker_fakes import FakeRedis
from worker.fetching.fetch import FetchError, Fetcher
from worker.fetching.http_client import HttpClient
from worker.politeness import Refused
from worker.politeness.addresses import AddressGuard, GuardedResolver, system_resolve
from worker.politeness.gate import build_gate
from worker.politeness.tdmrep import TDMREP_PATH, fetch_tdmrep
from worker.politeness.robots import ALLOW_ALL, DISALLOW_ALL, UNAVAILABLE, fetch_robots, origin_of
from worker.fetching.tokens import TokenBuckets

pytestmark = pytest.mark.paced  # runs by itself, after the rest (pytest.ini)

PUBLIC_IP = "93.184.216.34"  # public.test; connects to it are diverted to the local site
REBIND = "rebind.test"       # public to the guard's lookup, loopback to the connecting layers'
NAMES = {
    "public.test": [PUBLIC_IP],
    "localhost": ["127.0.0.1", "::1"],
    "internal.test": ["10.0.0.5"],
    "metadata.test": ["169.254.169.254"],
    "mixed.test": [PUBLIC_IP, "192.168.0.1"],
    "v6only.test": ["::1"],
    "mapped.test": ["::ffff:127.0.0.1"],
    "nat64.test": ["64:ff9b::a9fe:a9fe"],
    "scoped.test": ["fe80::1%2"],
    "sitelocal.test": ["fec0::1"],
}
SOURCE = "spellings"
SETTINGS = Settings(crawl_user_agent=TEST_USER_AGENT, crawl_allow_private_networks=False)


# --- the spellings ------------------------------------------------------------
DIGIT_FAMILIES = {  # ten code points each, for 0-9
    "fullwidth": "".join(map(chr, range(0xFF10, 0xFF1A))),
    "segmented": "".join(map(chr, range(0x1FBF0, 0x1FBFA))),
    "math-bold": "".join(map(chr, range(0x1D7CE, 0x1D7D8))),
    "math-double-struck": "".join(map(chr, range(0x1D7D8, 0x1D7E2))),
    "math-sans": "".join(map(chr, range(0x1D7E2, 0x1D7EC))),
    "math-sans-bold": "".join(map(chr, range(0x1D7EC, 0x1D7F6))),
    "math-monospace": "".join(map(chr, range(0x1D7F6, 0x1D800))),
    "superscript": "⁰¹²³⁴⁵⁶⁷⁸⁹",
    "subscript": "".join(map(chr, range(0x2080, 0x208A))),
    "circled": "⓪①②③④⑤⑥⑦⑧⑨",
    "arabic-indic": "".join(map(chr, range(0x0660, 0x066A))),   # not mapped by UTS 46
    "devanagari": "".join(map(chr, range(0x0966, 0x0970))),     # not mapped by UTS 46
}
DOTS = {"ideographic": "\u3002", "fullwidth": "\uff0e", "halfwidth-ideographic": "\uff61"}
TARGETS = ["127.0.0.1", "169.254.169.254", "10.0.0.1", "0.0.0.0"]


def in_digits(text: str, family: str) -> str:
    digits = DIGIT_FAMILIES[family]
    return "".join(digits[int(c)] if c.isdigit() else c for c in text)


def numeric_forms(address: str) -> dict[str, str]:
    """The WHATWG / inet_aton spellings of an IPv4 address."""
    n, b = int(ipaddress.IPv4Address(address)), [int(x) for x in address.split(".")]
    return {
        "decimal": str(n), "hex": hex(n), "hex-upper": "0X" + format(n, "X"),
        "octal": "0" + format(n, "o"), "dotted-octal": ".".join("0" + format(x, "o") for x in b),
        "dotted-hex": ".".join(hex(x) for x in b), "short-a.b": f"{b[0]}.{n & 0xFFFFFF}",
        "short-a.b.c": f"{b[0]}.{b[1]}.{n & 0xFFFF}",
        "leading-zeros": ".".join(f"{x:03d}" if x < 8 else str(x) for x in b),  # 010 is 8
        "trailing-dot": address + ".", "mixed-radix": f"{hex(b[0])}.0{b[1]:o}.{b[2]}.{b[3]}",
    }


def fullwidth_letters(name: str) -> str:
    return "".join(chr(ord(c) + 0xFEE0) if c.isalnum() and c.isascii() else "\uff0e" if c == "." else c
                   for c in name)


def spellings() -> list[tuple[str, str]]:
    """(category, authority): each names a forbidden address, or nothing connectable."""
    out: list[tuple[str, str]] = []
    out += [("ipv4", a) for a in TARGETS + ["127.8.9.10", "172.16.5.4", "192.168.0.1", "100.64.0.1",
                                              "192.0.0.8", "198.18.0.1", "240.0.0.1", "224.0.0.1",
                                              "255.255.255.255", "192.0.2.1", "192.88.99.1"]]
    out += [(f"ipv4-{form}", text) for a in TARGETS for form, text in numeric_forms(a).items()]
    out += [(f"digits-{family}", in_digits(a, family)) for family in DIGIT_FAMILIES for a in TARGETS]
    out += [(f"first-label-{family}", in_digits(a.split(".", 1)[0], family) + "." + a.split(".", 1)[1])
            for family in DIGIT_FAMILIES for a in ("127.0.0.1", "169.254.169.254")]
    out += [(f"dots-{name}", a.replace(".", dot)) for name, dot in DOTS.items() for a in TARGETS]
    out += [("fullwidth-all", fullwidth_letters(a)) for a in TARGETS]
    out += [("fullwidth-hex", fullwidth_letters("0x7f.1")), ("fullwidth-decimal", fullwidth_letters("2130706433"))]
    for name in NAMES:
        if name == "public.test":
            continue
        out += [("name", name), ("name-upper", name.upper()), ("name-trailing-dot", name + "."),
                ("name-fullwidth", fullwidth_letters(name))]
        if "." in name:
            out += [("name-ideographic-dot", name.replace(".", "\u3002"))]
    out += [("name", REBIND), ("name-upper", REBIND.upper()), ("name-fullwidth", fullwidth_letters(REBIND))]
    out += [("name-invisible", "local\u00adhost"), ("name-invisible", "local\u200bhost"),
            ("name-invisible", "internal\u200d.test"), ("name-circled", "ⓛⓞⓒⓐⓛⓗⓞⓢⓣ"),
            ("name-double-dot", "localhost.."), ("name-mixed-case", "LoCaLhOsT")]
    out += [("userinfo", u) for u in (
        "evil.com@127.0.0.1", "user:pass@127.0.0.1", "public.test@127.0.0.1", "public.test:80@127.0.0.1",
        "a@b@127.0.0.1", "public.test%40@169.254.169.254", "x@localhost", "@127.0.0.1",
        "public.test\\@127.0.0.1", "127.0.0.1\\@public.test", "public.test\\.127.0.0.1",
        "public.test\\\\127.0.0.1", "127.0.0.1\\public.test", "user@[::1]", "user@🯱🯲🯷.0.0.1")]
    out += [("ipv6", h) for h in (
        "[::1]", "[0:0:0:0:0:0:0:1]", "[0000:0000:0000:0000:0000:0000:0000:0001]", "[::0:1]", "[::]",
        "[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "[::FFFF:7F00:0001]", "[::ffff:169.254.169.254]",
        "[::ffff:a9fe:a9fe]", "[::ffff:0.0.0.0]", "[0:0:0:0:0:ffff:127.0.0.1]",
        "[::127.0.0.1]", "[::7f00:1]", "[::a9fe:a9fe]",
        "[64:ff9b::127.0.0.1]", "[64:ff9b::7f00:1]", "[64:ff9b::a9fe:a9fe]", "[64:ff9b::10.0.0.1]",
        "[64:ff9b:1::a9fe:a9fe]", "[64:ff9b:1::808:808]",
        "[2002:7f00:1::]", "[2002:a9fe:a9fe::1]", "[2002:808:808::1]",
        "[2001:0:4136:e378:8000:63bf:80ff:fffe]", "[2001::1]",
        "[fe80::1]", "[FE80::1]", "[fe80::1%25eth0]", "[fe80::1%eth0]", "[fe80::1%251]", "[fe80::a9fe:a9fe]",
        "[fec0::1]", "[fc00::1]", "[fd00:ec2::254]", "[ff02::1]", "[ff0e::1]", "[3fff::1]",
        "[2001:db8::1]", "[100::1]", "[5f00::1]", "[::1]:", "[::１]", "[::ffff:１２７.0.0.1]")]
    out += [("percent", p) for p in (
        "%31%32%37.0.0.1", "127%2E0%2E0%2E1", "%6c%6f%63%61%6c%68%6f%73%74", "127.0.0.1%00",
        "%EF%BC%91%EF%BC%92%EF%BC%97.0.0.1", "%F0%9F%AF%B1%F0%9F%AF%B2%F0%9F%AF%B7.0.0.1",
        "[::1%25]", "169.254.169.254%2f")]
    return list({authority: (category, authority) for category, authority in reversed(out)}.values())[::-1]


SPELLINGS = spellings()
PUBLIC_SPELLINGS = [  # these must reach the public address, and only it
    "public.test", "PUBLIC.TEST", "public.test.", fullwidth_letters("public.test"), "public\u3002test",
    "user@public.test", PUBLIC_IP, str(int(ipaddress.IPv4Address(PUBLIC_IP))), "0x5db8d822",
    in_digits(PUBLIC_IP, "segmented"),
]


def test_the_spellings_are_many_and_distinct():
    authorities = [authority for _category, authority in SPELLINGS]
    assert len(set(authorities)) == len(authorities) >= 200


# --- the network, faked ---------------------------------------------------------
class FakeNetwork(AbstractResolver):
    """DNS from NAMES, and every TCP connect seen before it is made."""

    def __init__(self, site_port: int, infrastructure: set[tuple[str, int]], real_connect):
        self.site_port = site_port
        self.infrastructure = infrastructure  # Redis: the test's own, not a crawl
        self.connects: list[tuple[str, int]] = []
        self.lookups: list[tuple[str, str]] = []  # (who, host)
        self._real_connect = real_connect  # the loop's own, before the test replaces it

    def answer(self, host: str, who: str) -> list[str]:
        self.lookups.append((who, host))
        name = host[:-1] if host.endswith(".") else host  # DNS reads a name and its FQDN alike
        if name == REBIND:
            return [PUBLIC_IP] if who == "guard" else ["127.0.0.1"]
        if name in NAMES:
            return NAMES[name]
        try:  # literals as the system reads them (127.1 too); never a query on the network
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
        except (OSError, UnicodeError):
            raise socket.gaierror(socket.EAI_NONAME, f"{host!r} is not a test name") from None
        return [f"{i[4][0]}%{i[4][3]}" if len(i[4]) == 4 and i[4][3] else i[4][0] for i in infos]

    async def guard_resolve(self, host: str, port: int) -> list[str]:
        return self.answer(host, "guard")

    async def resolve(self, host, port=0, family=socket.AF_INET):
        results = []
        for address in self.answer(host, "connect"):
            ip = ipaddress.ip_address(address)
            results.append({"hostname": host, "host": address, "port": port, "proto": 0,
                            "family": socket.AF_INET6 if ip.version == 6 else socket.AF_INET,
                            "flags": socket.AI_NUMERICHOST})
        return results

    async def close(self):
        pass

    async def sock_connect(self, sock, address):
        host, port = address[0], address[1]
        if (host, port) in self.infrastructure:
            return await self._real_connect(sock, address)
        self.connects.append((host, port))
        if host == PUBLIC_IP:
            return await self._real_connect(sock, ("127.0.0.1", self.site_port))
        raise ConnectionRefusedError(f"test: no connect to {host}:{port}")

    def forbidden_connects(self) -> list[tuple[str, int]]:
        return [c for c in self.connects if c[0] != PUBLIC_IP]

    def names_connected_unjudged(self) -> set[str]:
        """Names a connecting layer looked up that the guard did not judge (it judges IP
        literals without a lookup)."""
        judged = {host for who, host in self.lookups if who == "guard"}
        return {host for who, host in self.lookups if who == "connect" and not _is_literal(host)} \
            - judged - {"public.test"}


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


@pytest.fixture
async def world(redis_client, redis_url, monkeypatch):
    """A local site behind public.test, the faked network, and the worker's parts built on it."""
    redis_address = urlsplit(redis_url)
    async with Site() as site:
        loop = asyncio.get_running_loop()
        net = FakeNetwork(int(site.url.rsplit(":", 1)[1]),
                          {(redis_address.hostname, redis_address.port)}, loop.sock_connect)
        monkeypatch.setattr(loop, "sock_connect", net.sock_connect)
        client = HttpClient(TEST_USER_AGENT, resolver=GuardedResolver(net))
        tokens = FakeRedis()
        await tokens.set(tokens_key(SOURCE), 1_000_000)
        gate = build_gate(SETTINGS, redis_client, client, resolve=net.guard_resolve)
        fetcher = Fetcher(client, gate, TokenBuckets(tokens), 10_000, total_timeout=10)
        try:
            yield site, net, client, fetcher
        finally:
            await client.close()


# RobotsUnavailable: robots.txt of a host that resolves nowhere could not be had, so nothing was asked.
REFUSALS = {"ForbiddenAddress", "InvalidURL", "BadRedirect", "RobotsDisallowed", "RobotsUnavailable",
            "ConnectionError"}


async def outcome(fetcher: Fetcher, url: str) -> str:
    try:
        fetched = await fetcher.fetch(url, SOURCE)
    except FetchError as exc:
        return exc.status
    fetched.body.release()
    return str(fetched.status)


async def client_alone(client: HttpClient, url: str) -> str:
    try:
        async with client.get(url) as response:
            return str(response.status)
    except Refused as exc:
        return exc.reason
    except (ValueError, OSError) as exc:
        return type(exc).__name__


def ids(spelling: tuple[str, str]) -> str:
    return f"{spelling[0]}:{spelling[1].encode('unicode_escape').decode()}"


@pytest.mark.parametrize("spelling", SPELLINGS, ids=ids)
async def test_a_forbidden_spelling_is_never_connected_to(world, spelling):
    site, net, client, fetcher = world
    url = f"http://{spelling[1]}:{net.site_port}/x.jpg"
    results = {"fetcher": await outcome(fetcher, url)}
    assert net.forbidden_connects() == [], f"through the whole fetcher: {results}"
    assert results["fetcher"] in REFUSALS
    assert net.names_connected_unjudged() == set()
    assert site.hits == []
    # the connecting layer alone (mixed.test may reach its public address: no harm)
    results["client alone"] = await client_alone(client, url)
    assert net.forbidden_connects() == [], results


@pytest.mark.parametrize("spelling", SPELLINGS, ids=ids)
async def test_a_redirect_to_a_forbidden_spelling_is_never_followed(world, spelling):
    site, net, client, fetcher = world
    target = f"http://{spelling[1]}:{net.site_port}/x.jpg"
    site.pages["/hop"] = Page(302, headers={"Location": target})
    first = f"http://public.test:{net.site_port}/hop"
    result = await outcome(fetcher, first)
    assert net.forbidden_connects() == [], f"through the whole fetcher: {result}"
    assert result in REFUSALS
    assert net.names_connected_unjudged() == set()
    # robots.txt redirected to the spelling: with the guard, and with the client's resolver alone
    site.pages["/robots.txt"] = Page(301, headers={"Location": target})
    origin = f"http://public.test:{net.site_port}"
    guarded = AddressGuard(resolve=net.guard_resolve)
    # refused (disallow), or a name that resolves nowhere (unavailable: its URLs wait)
    assert (await fetch_robots(client, origin, guarded)).verdict in (DISALLOW_ALL, UNAVAILABLE)
    assert net.forbidden_connects() == [], "robots.txt, guarded"
    assert {hit.path for hit in site.hits} <= {"/hop", "/robots.txt", TDMREP_PATH}
    await fetch_robots(client, origin, AddressGuard(enabled=False))
    assert net.forbidden_connects() == [], "robots.txt, the client's resolver alone"
    # tdmrep.json redirected to the spelling: the same guard on every hop
    site.pages[TDMREP_PATH] = Page(301, headers={"Location": target})
    assert (await fetch_tdmrep(client, origin, guarded)).verdict in (DISALLOW_ALL, UNAVAILABLE)
    assert net.forbidden_connects() == [], "tdmrep.json, guarded"


@pytest.mark.parametrize("authority", PUBLIC_SPELLINGS, ids=lambda a: a.encode("unicode_escape").decode())
async def test_a_public_spelling_connects_to_the_address_the_guard_judged(world, authority):
    site, net, client, fetcher = world
    assert await outcome(fetcher, f"http://{authority}:{net.site_port}/x.jpg") == "200"
    assert await client_alone(client, f"http://{authority}:{net.site_port}/y.jpg") == "200"
    assert {host for host, _port in net.connects} == {PUBLIC_IP}
    assert net.names_connected_unjudged() == set()
    assert site.paths() == ["/robots.txt", TDMREP_PATH, "/x.jpg", "/y.jpg"]
    site.pages["/robots.txt"] = Page(404)
    robots = await fetch_robots(client, origin_of(f"http://{authority}:{net.site_port}/"),
                                AddressGuard(resolve=net.guard_resolve))
    assert robots.verdict == ALLOW_ALL  # the same host, robots.txt alone


# --- end to end, against a real loopback server -----------------------------------
@pytest.mark.parametrize("host", ["🯱🯲🯷.0.0.1", "127。0。0。1", "2130706433", "[::ffff:127.0.0.1]"])
async def test_the_reported_url_reaches_nothing_on_loopback(redis_client, host):
    """The issue's URL, with the system resolver and nothing faked: zero requests at the site."""
    async with Site() as site:
        port = site.url.rsplit(":", 1)[1]
        client = HttpClient(TEST_USER_AGENT, resolver=GuardedResolver())
        tokens = FakeRedis()
        await tokens.set(tokens_key(SOURCE), 10)
        fetcher = Fetcher(client, build_gate(SETTINGS, redis_client, client, resolve=system_resolve),
                          TokenBuckets(tokens), 10_000, total_timeout=10)
        try:
            assert await outcome(fetcher, f"http://{host}:{port}/x.jpg") in {"ForbiddenAddress", "InvalidURL"}
            assert await client_alone(client, f"http://{host}:{port}/x.jpg") == "ForbiddenAddress"
            assert (await fetch_robots(client, f"http://{host}:{port}", AddressGuard(enabled=False))).verdict \
                in (DISALLOW_ALL, UNAVAILABLE)  # the client's resolver alone refuses it
        finally:
            await client.close()
    assert site.hits == []
