"""An outcome's counts in the real Redis (worker.outcomes.stats: one script call, SPEC.md §2's keys),
and the fake's copy of the script held to the same result."""
from __future__ import annotations

import json
import time

from common import contracts
from common.response_times import OVERLOAD_FIELD, RESPONSE_BUCKET_TTL_SECONDS, bin_of, bucket_start
from test.worker_fakes import FakeRedis
from worker.outcomes.stats import Stats


async def record_three(stats: Stats, source: str) -> None:
    await stats.record(source, "200", success=True, ttfb=0.03, terminal=True)
    await stats.record(source, "503", success=False, ttfb=0.2, terminal=False)  # a retry
    await stats.record(source, "RobotsDisallowed", success=False, windows=False, terminal=True)


async def test_an_outcome_counts_everywhere_the_monitor_and_operators_read(redis_client) -> None:
    before = time.time()
    await record_three(Stats(redis_client), "src")
    r = redis_client
    assert await r.lrange(contracts.last_50_key("src"), 0, -1) == ["200", "503"]  # not the one never sent
    assert sorted(m.split(":")[0] for m in await r.zrange(contracts.one_minute_window_key("src"), 0, -1)) \
        == ["200", "503"]
    for prefix in contracts.STATUS_COUNT_WINDOWS:
        counts = await r.hgetall(contracts.status_window_key(prefix, "src"))
        assert sorted(field.split(":")[1] for field in counts) == ["200", "503"]
        assert await r.ttl(contracts.status_window_key(prefix, "src")) > 0
    bucket = contracts.response_times_key("src", bucket_start(time.time()))
    if bucket_start(before) == bucket_start(time.time()):
        assert await r.hgetall(bucket) == {str(bin_of(0.03)): "1", str(bin_of(0.2)): "1", OVERLOAD_FIELD: "1"}
        assert 0 < await r.ttl(bucket) <= RESPONSE_BUCKET_TTL_SECONDS
    assert (await r.zscore(contracts.ACTIVE_SOURCES, "src")) >= before
    assert await r.mget(contracts.NUM_RESIZED, contracts.resized_key("src"), contracts.RESIZE_ERRORS,
                        contracts.errors_key("src"), contracts.errors_key("src", "503")) == ["1", "1", "2", "2", "1"]
    assert await r.smembers(contracts.error_statuses_key("src")) == {"503", "RobotsDisallowed"}
    assert await r.get(contracts.urls_ended_key("src")) == "2"  # the retry is still in the backlog
    assert 0 < await r.ttl(contracts.one_minute_window_key("src")) <= 61
    assert 0 < await r.ttl(contracts.last_50_key("src")) <= contracts.SOURCE_STATE_TTL_SECONDS


async def test_a_key_of_the_wrong_type_is_reported_and_the_rest_still_counts(redis_client, capsys) -> None:
    await redis_client.set(contracts.last_50_key("odd"), "an operator's typo")
    await Stats(redis_client).record("odd", "200", success=True, ttfb=0.03, terminal=True)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["event"] for line in lines] == [contracts.EVENT_STATS_REJECTED]
    assert "WRONGTYPE" in lines[0]["error"]
    assert await redis_client.get(contracts.resized_key("odd")) == "1"
    assert await redis_client.zcard(contracts.one_minute_window_key("odd")) == 1


async def test_the_fake_runs_the_script_as_redis_does() -> None:
    fake = FakeRedis()
    await record_three(Stats(fake), "src")
    assert fake.store[contracts.last_50_key("src")] == ["200", "503"]
    assert fake.integer(contracts.errors_key("src")) == 2 and fake.integer(contracts.resized_key("src")) == 1
    assert fake.store[contracts.error_statuses_key("src")] == {"503", "RobotsDisallowed"}
    assert fake.integer(contracts.urls_ended_key("src")) == 2
    assert sorted(m.split(":")[0] for m in fake.store[contracts.one_minute_window_key("src")]) == ["200", "503"]


async def test_a_retried_url_counts_one_error_in_the_breakers_minute(redis_client) -> None:
    """A 500 retried and failing again is one error in status60s (its last 50 and counters hold both);
    a retry that succeeds, or ends in an expected status, counts as such."""
    stats = Stats(redis_client)
    await stats.record("twice", "500", success=False, ttfb=0.1, terminal=False)
    await stats.record("twice", "500", success=False, ttfb=0.1, terminal=True, retried=True)
    await stats.record("twice", "Timeout", success=False, terminal=False)
    await stats.record("twice", "200", success=True, ttfb=0.1, terminal=True, retried=True)
    await stats.record("twice", "UnidentifiedImageError", success=False, ttfb=0.1, terminal=True, retried=True)
    minute = sorted(m.split(":")[0] for m in await redis_client.zrange(contracts.one_minute_window_key("twice"), 0, -1))
    assert minute == ["200", "500", "Timeout", "UnidentifiedImageError"]
    assert await redis_client.lrange(contracts.last_50_key("twice"), 0, -1) == [
        "500", "500", "Timeout", "200", "UnidentifiedImageError"]
    assert await redis_client.get(contracts.errors_key("twice", "500")) == "2"


async def test_an_answer_scores_its_source_active_before_its_outcome(redis_client) -> None:
    """The monitor judges the answers of the sources active lately; an answer counted as it comes
    makes its source one, so a slow start is judged before the image pool has ended its first URL."""
    from crawl_monitor.active_sources import active_since
    before = time.time()
    await Stats(redis_client).answered("early", 0.2)
    assert "early" in await active_since(redis_client, before)
    assert await active_since(redis_client, time.time() + 1) == set()


async def test_an_answer_counts_its_bin_and_expires_its_bucket_once(redis_client) -> None:
    """Stats.answered: one script call, the same keys the pipeline it replaced left; a key of the
    wrong type is refused as the pipeline's first error was (the task ends the URL: RedisRefused)."""
    from common.redis_client import refuses_the_value
    stats = Stats(redis_client)
    for _ in range(3):  # within one bucket, as a rule: the test retries across a bucket's edge
        started = bucket_start(time.time())
        await stats.answered("answers", 0.03)
        await stats.answered("answers", 0.2)
        if bucket_start(time.time()) == started:
            break
    bucket = contracts.response_times_key("answers", started)
    assert await redis_client.hgetall(bucket) == {str(bin_of(0.03)): "1", str(bin_of(0.2)): "1"}
    assert 0 < await redis_client.ttl(bucket) <= RESPONSE_BUCKET_TTL_SECONDS
    await redis_client.persist(bucket)
    await stats.answered("answers", 0.03)
    if bucket_start(time.time()) == started:  # its expiry was set by the first answer of the bucket only
        assert await redis_client.ttl(bucket) == -1
    wrong = contracts.response_times_key("wrong", bucket_start(time.time()))
    await redis_client.set(wrong, "an operator's typo")
    try:
        await Stats(redis_client).answered("wrong", 0.03)
    except Exception as exc:  # noqa: BLE001 - which one is the assertion
        assert refuses_the_value(exc), repr(exc)
    else:
        raise AssertionError("a key of the wrong type was not refused")
