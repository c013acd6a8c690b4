"""The monitor's batched reads and writes by script answer as redis-py's own commands do, on the real Redis."""
from __future__ import annotations

import pytest

from crawl_monitor.batched_keys import KEYS_BATCH, BatchedKeys


@pytest.mark.parametrize("count", [0, 3, KEYS_BATCH + 7])
async def test_each_read_answers_as_its_command_in_the_order_of_the_keys(redis_client, unique, count) -> None:
    """Past a batch too, with missing keys and unicode among them."""
    hashes = [f"{unique}:h:{n}" for n in range(count)]
    lists = [f"{unique}:l:{n}" for n in range(count)]
    sets = [f"{unique}:s:{n}" for n in range(count)]
    for n in range(0, count, 2):  # every other key is missing
        await redis_client.hset(hashes[n], mapping={"multiplier": n, "é": "ü", "overload": "x"})
        await redis_client.rpush(lists[n], *[str(i) for i in range(n % 60)], "200")
        await redis_client.sadd(sets[n], "500", "Timeout", f"é{n}")
    keys = BatchedKeys(redis_client)
    pipe = redis_client.pipeline(transaction=False)
    for key in hashes:
        pipe.hgetall(key)
    for key in lists:
        pipe.lrange(key, -50, -1)
    for key in sets:
        pipe.smembers(key)
    expected = await pipe.execute()
    assert await keys.hashes(hashes) == expected[:count]
    assert await keys.lists(lists, -50, -1) == expected[count:2 * count]
    assert await keys.sets(sets) == expected[2 * count:]


async def test_saved_hashes_are_set_and_expire_as_hset_and_expire_would(redis_client, unique) -> None:
    mappings = {f"{unique}:a:{n}": {"effective_rate": f"{n / 3:.6g}", "slow_start": str(n % 2)}
                for n in range(KEYS_BATCH + 2)}
    mappings[f"{unique}:one"] = {"enabled": "1", "gone": ""}
    await redis_client.hset(f"{unique}:one", mapping={"kept": "yes", "gone": "12"})
    await BatchedKeys(redis_client).save_hashes(mappings, 3600)
    for key, mapping in mappings.items():
        assert {k: v for k, v in (await redis_client.hgetall(key)).items() if k != "kept"} == {
            k: v for k, v in mapping.items() if v}
        assert 3590 < await redis_client.ttl(key) <= 3600
    assert (await redis_client.hgetall(f"{unique}:one"))["kept"] == "yes"  # HSET adds, as before
    assert "gone" not in await redis_client.hgetall(f"{unique}:one")  # an empty value deletes its field


async def test_buckets_up_to_a_cut_off_are_dropped_as_bucket_of_field_reads_them(redis_client, unique) -> None:
    """The count windows' trim by script: a field whose bucket started at or before its key's cut-off
    goes (one of another shape too, as ``bucket_of_field`` gives it -1), the rest stay; past the
    1,000 fields one HDEL takes, and past a batch of keys."""
    from common.contracts import bucket_of_field
    many = {f"{unique}:many": {f"{start}:200": 1 for start in range(2500)}}
    keys = {f"{unique}:w:{n}": {f"{100 + n}:500": 1, f"{200 + n}:404": 2, "garbled": 3, "12x:200": 4}
            for n in range(KEYS_BATCH + 3)}
    for key, fields in (many | keys).items():
        await redis_client.hset(key, mapping=fields)
    cutoffs = {f"{unique}:many": 2000.0} | {key: 150.0 for key in keys} | {f"{unique}:missing": 10.0}
    dropped = await BatchedKeys(redis_client).drop_buckets_up_to(cutoffs)
    expected = {key: sorted(f for f in fields if bucket_of_field(f) > cutoffs[key])
                for key, fields in (many | keys).items()}
    assert {key: sorted(await redis_client.hkeys(key)) for key in expected} == expected
    assert dropped == sum(len(fields) for fields in (many | keys).values()) - sum(map(len, expected.values()))
