"""The real-shaped bench's trace: a site's grant laid beside its requests."""
from __future__ import annotations

import time

import pytest
import redis

from bench.grant_trace import SAMPLE_SECONDS, GrantSampler, Row, Sample, trace_rows
from common import contracts
from demo.simweb import ROBOTS_PATH, RequestRecord

FIRST = 1_000.0


def request(at: float, served_in: float, path: str = "/a.jpg") -> RequestRecord:
    return RequestRecord(FIRST + at, "craftpics.test", path, 200, "bot", served_in)


SAMPLES = [Sample(FIRST - 0.1, 6.4, True, None), Sample(FIRST + 0.6, 12.8, True, None),
           Sample(FIRST + 1.1, 4.0, False, FIRST + 2.0)]
REQUESTS = [request(0.0, 0.2), request(0.3, 0.4), request(0.4, 0.1, ROBOTS_PATH), request(0.7, 0.3),
            request(2.2, 0.2)]


@pytest.mark.parametrize("n, row", [
    (0, Row(0.0, 6.4, "start", 2, 300.0)),   # a rules file is not an image request
    (1, Row(0.5, 6.4, "start", 1, 300.0)),   # the grant at the bin's start, not one sampled within it
    (2, Row(1.0, 12.8, "start", 0, None)),
    (3, Row(1.5, 4.0, "drain", 0, None)),
    (4, Row(2.0, 4.0, "steps", 1, 200.0)),   # the drain is over at its end
])
def test_a_bin_holds_the_grant_at_its_start_and_the_requests_that_arrived_in_it(n, row) -> None:
    rows = trace_rows(SAMPLES, REQUESTS, FIRST)
    assert len(rows) == 5 and rows[n] == row


def test_no_image_request_no_rows_and_no_sample_no_grant() -> None:
    assert trace_rows(SAMPLES, [request(0.0, 0.1, ROBOTS_PATH)], FIRST) == []
    assert trace_rows([], [request(0.0, 0.1)], FIRST) == [Row(0.0, None, "-", 1, 100.0)]


def test_the_sampler_reads_what_the_back_off_saved(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.hset(contracts.adaptive_key("craftpics.test"),
                mapping={"effective_rate": "12.8", contracts.ADAPTIVE_SLOW_START_FIELD: "1"})
    with GrantSampler(redis_url, ["craftpics.test", "unseen.test"]) as sampler:
        deadline = time.monotonic() + 20 * SAMPLE_SECONDS
        while not sampler.samples["craftpics.test"] and time.monotonic() < deadline:
            time.sleep(SAMPLE_SECONDS)
    sample = sampler.samples["craftpics.test"][0]
    assert (sample.rate, sample.slow_start, sample.drain_until) == (12.8, True, None)
    assert sampler.samples["unseen.test"] == []  # no state saved: no grant to show
    client.close()
