"""One active monitor: the lease on a real Redis."""
from __future__ import annotations

import asyncio
import json

import pytest

from common import contracts
from crawl_monitor.lease import LeaseLost, MonitorLease
from crawl_monitor.periodic import every


def events(capsys, name: str) -> list[dict]:
    return [e for e in map(json.loads, capsys.readouterr().out.splitlines()) if e["event"] == name]


async def test_a_second_monitor_stands_by_until_the_first_hands_over(redis_client, capsys) -> None:
    first, second = MonitorLease(redis_client, "first"), MonitorLease(redis_client, "second")
    await first.acquire()
    waiting = asyncio.create_task(second.acquire(retry_seconds=0.05))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    assert [e["active"] for e in events(capsys, contracts.EVENT_MONITOR_STANDBY)] == ["first"]  # logged once
    await first.release()
    await asyncio.wait_for(waiting, 2)
    assert await redis_client.get(contracts.MONITOR_LEASE) == "second"
    assert [e["previous"] for e in events(capsys, contracts.EVENT_MONITOR_LEASE_TAKEN)] == ["first"]
    await first.release()  # not the holder any more: changes nothing
    assert await redis_client.get(contracts.MONITOR_LEASE) == "second"


async def test_a_crashed_monitors_lease_expires(redis_client) -> None:
    crashed, standby = MonitorLease(redis_client, "crashed", ttl_ms=300), MonitorLease(redis_client, "standby")
    await crashed.acquire()  # and never renews
    await asyncio.wait_for(standby.acquire(retry_seconds=0.05), 2)
    with pytest.raises(LeaseLost, match="standby"):
        await crashed.renew()


async def test_renewal_extends_and_survives_an_emptied_redis(redis_client) -> None:
    lease = MonitorLease(redis_client, "me", ttl_ms=5000)
    await lease.acquire()
    await redis_client.pexpire(contracts.MONITOR_LEASE, 100)
    await lease.renew()
    assert await redis_client.pttl(contracts.MONITOR_LEASE) > 4000
    emptied = []
    lease.on_emptied = lambda: emptied.append(True)
    await lease.renew()
    assert emptied == []
    await redis_client.flushdb()  # Redis restarted without persistence: the lease is taken again
    await lease.renew()
    assert await redis_client.get(contracts.MONITOR_LEASE) == "me"
    assert emptied == [True]  # what the monitor writes only when it changes is written again
    await lease.renew()
    assert emptied == [True]


async def test_keeping_the_lease_ends_when_another_monitor_holds_it(redis_client) -> None:
    lease = MonitorLease(redis_client, "me")
    await lease.acquire()
    keeping = asyncio.create_task(every(0.05, lease.renew, "lease"))
    await asyncio.sleep(0.2)
    assert not keeping.done()
    await redis_client.set(contracts.MONITOR_LEASE, "usurper")
    with pytest.raises(LeaseLost, match="usurper"):
        await asyncio.wait_for(keeping, 2)
