"""Every outcome path of one URL, with fakes for the fetcher, Kafka, S3 and Redis."""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest
from confluent_kafka import KafkaError
from multidict import CIMultiDict
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError

from common.contracts import EVENT_DOWNSTREAM_REFUSED, EVENT_INFRA_RETRY, EVENT_OUTCOME_UNWRITABLE
from common.contracts import (CRAWL_ERRORS_TOPIC, INBOUND_TOPIC, LINK_ROT_TOPIC, METADATA_TOPIC,
                              NUM_RESIZED, RESIZE_ERRORS, CrawlRequest, errors_key, last_50_key,
                              OPTED_OUT, OPTED_OUT_TOPIC, OUTCOME_TOPICS, opted_out_key,
                              parse_crawl_request, resized_key, status_window_key, urls_ended_key)
from common.kafka import MessageRefused
from common.response_times import OVERLOAD_FIELD, bin_of
from common.settings import Settings
from test.worker_fakes import (FakeProducer, FakeRedis, FakeThumbnails, exif_jpeg, image_bytes,
                               png_bomb)
from worker.outcomes import task as task_module
from worker.fetching.fetch import Fetched, FetchError
from worker.imaging.analysis import analyze
from worker.politeness.consent import Decision
from worker.fetching.shared_memory import Body, SegmentPool, SegmentUnavailable
from worker.fetching.tokens import ShuttingDown, SourceHalted
from worker.outcomes.stats import Stats
from worker.metrics import OUTCOME_KINDS, REGISTRY
from worker.outcomes.task import ImageTask
from worker.imaging.thumbnails import S3PutFailed, ThumbnailRefused

SOURCE = "example"
SETTINGS = Settings(target_resolution=64, max_retries=1,
                    crawl_user_agent="cc-image-crawler/1.0 (+https://example.org/bot)")


class FakeFetcher:
    def __init__(self, result: Fetched | FetchError, redis_down_for: int = 0,
                 outage: type[Exception] = RedisConnectionError):
        self.result = result
        self.redis_down_for = redis_down_for
        self.outage = outage

    async def fetch(self, url: str, source: str) -> Fetched:
        if self.redis_down_for > 0:
            self.redis_down_for -= 1
            raise self.outage("tokens unavailable")
        if isinstance(self.result, FetchError):
            raise self.result
        return self.result


async def inline_analyze(body: Body, target: int):
    return analyze(body.bytes(), target)


def ok(body: bytes, status: int = 200, **headers: str) -> Fetched:
    multi = CIMultiDict()
    for name, value in headers.items():
        for one in value.split("|"):
            multi.add(name.replace("_", "-"), one)
    return Fetched("http://example.org/a.jpg", status, multi, Body.of(body), token_wait=0.0)


class Run:
    def __init__(self, result: Fetched | FetchError, attempts: int = 0, producer: FakeProducer | None = None,
                 redis_down_for: int = 0, outage: type[Exception] = RedisConnectionError,
                 analyze=inline_analyze, thumbnails: FakeThumbnails | None = None):
        self.redis = FakeRedis()
        self.producer = producer or FakeProducer()
        self.thumbnails = thumbnails or FakeThumbnails()
        self.fetcher = FakeFetcher(result, redis_down_for, outage)
        self.task = ImageTask(self.fetcher, analyze, self.thumbnails, self.producer,
                              Stats(self.redis), SETTINGS)
        self.request = CrawlRequest("http://example.org/a.jpg", "uuid-1", SOURCE, attempts)

    async def __call__(self) -> Run:
        await self.task.process(self.request)
        return self

    def outcomes(self) -> dict[str, list[dict]]:
        return {t: self.producer.on(t) for t in (*OUTCOME_TOPICS, INBOUND_TOPIC) if self.producer.on(t)}

    def last_statuses(self) -> list[str]:
        return self.redis.store.get(last_50_key(SOURCE), [])


async def test_success_publishes_quality_and_exif_stores_thumbnail_counts() -> None:
    body = exif_jpeg()
    run = await Run(ok(body))()
    exif, quality = run.producer.on(METADATA_TOPIC)
    assert exif["identifier"] == "uuid-1" and exif["exif"]["0x13b"] == "Alden Page"
    assert quality == {"identifier": "uuid-1", "width": 16, "height": 16, "compression_quality": 75,
                       "filesize": len(body), "x_robots_tag": []}
    assert set(run.outcomes()) == {METADATA_TOPIC}
    assert run.thumbnails.stored["uuid-1"].startswith(b"\xff\xd8")
    assert run.redis.integer(NUM_RESIZED) == 1 and run.redis.integer(resized_key(SOURCE)) == 1
    assert run.last_statuses() == ["200"]
    window = run.redis.store[status_window_key("status60s", SOURCE)]
    assert [member.split(":")[0] for member in window] == ["200"]


async def test_image_without_exif_sends_only_the_quality_message() -> None:
    run = await Run(ok(image_bytes("PNG")))()
    (quality,) = run.producer.on(METADATA_TOPIC)
    assert quality["compression_quality"] is None


@pytest.mark.parametrize("header, stored, directives", [
    ("noindex", False, ["noindex"]),
    ("cc-image-crawler: noimageindex", False, ["noimageindex"]),
    ("otherbot: noindex|nofollow", True, ["nofollow"]),
    ("unavailable_after: 25 Jun 2030 15:00:00 PST", True, ["unavailable_after: 25 jun 2030 15:00:00 pst"]),
])
async def test_x_robots_tag_directives_for_us_decide_the_thumbnail(header, stored, directives) -> None:
    run = await Run(ok(image_bytes("JPEG"), X_Robots_Tag=header))()
    quality = run.producer.on(METADATA_TOPIC)[-1]
    assert quality["x_robots_tag"] == directives
    assert ("uuid-1" in run.thumbnails.stored) is stored


@pytest.mark.parametrize("status", [404, 410])
async def test_missing_images_are_link_rot(status: int) -> None:
    run = await Run(ok(b"", status))()
    assert set(run.outcomes()) == {LINK_ROT_TOPIC}
    assert run.producer.on(LINK_ROT_TOPIC)[0]["identifier"] == "uuid-1"
    assert run.redis.integer(errors_key(SOURCE, str(status))) == 1 and run.last_statuses() == [str(status)]


@pytest.mark.parametrize("result, status", [
    (ok(b"", 503), "503"), (ok(b"", 429), "429"),
    (FetchError("Timeout"), "Timeout"), (FetchError("ServerDisconnected"), "ServerDisconnected"),
])
async def test_transient_failures_are_retried_through_inbound_images(result, status) -> None:
    run = await Run(result, attempts=0)()
    assert set(run.outcomes()) == {INBOUND_TOPIC}
    (retry,) = run.producer.on(INBOUND_TOPIC)
    paused = retry.pop("retry_after_since", None)
    assert retry == {"url": "http://example.org/a.jpg", "uuid": "uuid-1", "source": SOURCE, "attempts": 1}
    assert (paused is not None) == (status in ("429", "503"))  # a pausing answer marks the URL as having waited
    assert run.last_statuses() == [status] and run.redis.integer(RESIZE_ERRORS) == 1


@pytest.mark.parametrize("waits", [{"robots_wait_since": 1.7e9}, {"retry_after_since": 1.7e9},
                                   {"robots_wait_since": 1.7e9, "retry_after_since": 1.7e9 + 5}])
@pytest.mark.parametrize("result, topic", [(ok(exif_jpeg()), METADATA_TOPIC), (ok(b"", 404), LINK_ROT_TOPIC),
                                           (ok(b"", 503), CRAWL_ERRORS_TOPIC)])
async def test_a_url_that_waited_says_since_when_in_its_outcome(result, topic, waits) -> None:
    run = Run(result, attempts=1)
    run.request = replace(run.request, robots_wait_since=waits.get("robots_wait_since"),
                          retry_after_since=waits.get("retry_after_since"))
    await run()
    assert all({**message, **waits} == message for message in run.producer.on(topic))
    assert parse_crawl_request(run.request.to_json()) == run.request


async def test_exhausted_retries_end_in_crawl_errors() -> None:
    run = await Run(ok(b"", 503), attempts=1)()
    (error,) = run.producer.on(CRAWL_ERRORS_TOPIC)
    assert set(run.outcomes()) == {CRAWL_ERRORS_TOPIC}
    assert {k: error[k] for k in ("identifier", "url", "source", "reason", "status", "attempts")} == {
        "identifier": "uuid-1", "url": "http://example.org/a.jpg", "source": SOURCE,
        "reason": "HTTP 503", "status": 503, "attempts": 1}
    assert "time" in error
    # Its first attempt's 503 is the URL's one error in the breaker's minute; the last 50 holds this one too.
    assert not run.redis.store.get(status_window_key("status60s", SOURCE))
    assert run.last_statuses() == ["503"]


@pytest.mark.parametrize("result, reason, status", [
    (ok(b"", 403), "HTTP 403", 403),
    (ok(b"<html>not an image</html>"), "UnidentifiedImageError", 200),
    (ok(b""), "UnidentifiedImageError", 200),
    (ok(png_bomb()), "DecompressionBomb", 200),
    (FetchError("TooLarge", 200), "TooLarge", 200),
    (FetchError("TooManyRedirects", 302), "TooManyRedirects", 302),
])
async def test_other_ends_go_to_crawl_errors_and_the_windows(result, reason, status) -> None:
    run = await Run(result)()
    assert set(run.outcomes()) == {CRAWL_ERRORS_TOPIC}
    error = run.producer.on(CRAWL_ERRORS_TOPIC)[0]
    assert (error["reason"], error["status"]) == (reason, status)
    name = reason.removeprefix("HTTP ")
    assert run.last_statuses() == [name]
    assert run.redis.integer(errors_key(SOURCE, name)) == 1 and "uuid-1" not in run.thumbnails.stored


@pytest.mark.parametrize("result, status, signal, value, http_status", [
    (FetchError("RobotsDisallowed", decision=Decision("robots-txt", "User-agent: *: /a.jpg disallowed")),
     "RobotsDisallowed", "robots-txt", "User-agent: *: /a.jpg disallowed", None),
    (FetchError("RobotsDisallowed"), "RobotsDisallowed", "robots-txt", "RobotsDisallowed", None),
    (FetchError("OptedOut", decision=Decision("tdmrep-file", "/photos/* reserved")),
     "OptedOut", "tdmrep-file", "/photos/* reserved", None),
    (FetchError("OptedOut", 200, decision=Decision("x-robots-tag", "noai")), "OptedOut", "x-robots-tag", "noai", 200),
])
async def test_opt_outs_end_in_opted_out_with_the_signal_counted_not_as_errors(
        result, status, signal, value, http_status) -> None:
    run = await Run(result)()
    assert set(run.outcomes()) == {OPTED_OUT_TOPIC}
    (message,) = run.producer.on(OPTED_OUT_TOPIC)
    assert {k: message[k] for k in ("identifier", "url", "source", "signal", "value", "status")} == {
        "identifier": "uuid-1", "url": "http://example.org/a.jpg", "source": SOURCE, "signal": signal,
        "value": value, "status": http_status}
    assert run.redis.store[opted_out_key(SOURCE)] == {signal: 1} and run.redis.store[OPTED_OUT] == {signal: 1}
    assert run.redis.integer(RESIZE_ERRORS) == 0 and run.redis.integer(errors_key(SOURCE, status)) == 0
    assert run.last_statuses() == [status] and run.redis.integer(urls_ended_key(SOURCE)) == 1
    assert "uuid-1" not in run.thumbnails.stored


async def test_forbidden_address_is_counted_but_kept_out_of_the_breaker_windows() -> None:
    run = await Run(FetchError("ForbiddenAddress"))()
    assert run.producer.on(CRAWL_ERRORS_TOPIC)[0]["reason"] == "ForbiddenAddress"
    assert run.last_statuses() == []
    assert status_window_key("status60s", SOURCE) not in run.redis.store
    assert run.redis.integer(errors_key(SOURCE, "ForbiddenAddress")) == 1
    assert run.redis.integer(RESIZE_ERRORS) == 1


def worker_outcomes() -> dict[str, float]:
    """crawler_worker_outcomes_total by kind, as the worker's /metrics has them now."""
    return {kind: REGISTRY.get_sample_value("crawler_worker_outcomes_total", {"kind": kind}) or 0.0
            for kind in OUTCOME_KINDS}


@pytest.mark.parametrize("result, attempts, kind", [
    (ok(image_bytes("JPEG")), 0, "success"), (ok(b"", 410), 0, "link_rot"), (ok(b"", 503), 0, "retry"),
    (ok(b"", 503), 1, "crawl_error"), (FetchError("RobotsDisallowed"), 0, "opted_out"),
    (FetchError("RobotsUnavailable", retry_at=4102444800.0), 0, "robots_wait"),
])
async def test_each_outcome_counts_once_by_its_kind_in_the_workers_metrics(result, attempts, kind) -> None:
    before = worker_outcomes()
    await Run(result, attempts=attempts)()
    after = worker_outcomes()
    assert {k: after[k] - before[k] for k in OUTCOME_KINDS} == {k: float(k == kind) for k in OUTCOME_KINDS}


async def test_broker_outage_is_waited_out_not_an_outcome(monkeypatch) -> None:
    monkeypatch.setattr(task_module, "INFRA_RETRY_FIRST_DELAY", 0.01)
    retries = REGISTRY.get_sample_value("crawler_worker_infra_retries_total", {"service": "kafka"})
    run = await Run(ok(image_bytes("JPEG")), producer=FakeProducer(fail_first=3))()
    assert len(run.producer.on(METADATA_TOPIC)) == 1
    assert run.redis.integer(NUM_RESIZED) == 1
    assert REGISTRY.get_sample_value("crawler_worker_infra_retries_total", {"service": "kafka"}) == retries + 3


async def test_outage_retries_double_to_a_cap_each_jittered_down_by_up_to_half(monkeypatch, capsys) -> None:
    """Capped, so a task is back soon after its server; jittered, so a fleet's tasks that failed
    together do not all retry in the same instant."""
    monkeypatch.setattr(task_module, "INFRA_RETRY_FIRST_DELAY", 0.002)
    monkeypatch.setattr(task_module, "INFRA_RETRY_MAX_DELAY", 0.016)
    failures = iter(range(8))

    async def flaky() -> str:
        if next(failures, None) is not None:
            raise ConnectionError("down")
        return "up"

    assert await task_module.persist("redis", flaky) == "up"
    waits = [line["retry_in"] for line in logged(capsys.readouterr().out, EVENT_INFRA_RETRY)]
    nominal = [min(0.002 * 2 ** i, 0.016) for i in range(8)]
    assert len(waits) == 8
    assert all(d / 2 - 1e-3 <= w <= d + 1e-3 for w, d in zip(waits, nominal, strict=True)), (waits, nominal)
    assert len(set(waits[3:])) > 1, waits  # the capped waits differ: jittered


async def test_redis_outage_before_the_request_is_waited_out(monkeypatch) -> None:
    monkeypatch.setattr(task_module, "INFRA_RETRY_FIRST_DELAY", 0.01)
    run = await Run(ok(image_bytes("JPEG")), redis_down_for=2)()
    assert set(run.outcomes()) == {METADATA_TOPIC}


async def test_no_memory_for_a_body_is_waited_out_not_an_outcome(monkeypatch) -> None:
    monkeypatch.setattr(task_module, "INFRA_RETRY_FIRST_DELAY", 0.01)
    run = await Run(ok(image_bytes("JPEG")), redis_down_for=2, outage=SegmentUnavailable)()
    assert set(run.outcomes()) == {METADATA_TOPIC}


def in_a_segment(segments: SegmentPool, data: bytes) -> Fetched:
    segment = segments.take()
    segment.window(0)[:len(data)] = data
    return Fetched("http://example.org/a.jpg", 200, CIMultiDict(), Body(len(data), segment, segments), 0.0)


@pytest.mark.parametrize("analysis_fails", [False, True])
async def test_the_body_goes_back_to_the_pool_once_analysed(monkeypatch, analysis_fails: bool) -> None:
    """Before the outcome is published (which may wait out an outage), and also when analysis fails."""
    monkeypatch.setattr(task_module, "INFRA_RETRY_FIRST_DELAY", 0.01)
    segments = SegmentPool(1 << 20)
    fetched = in_a_segment(segments, image_bytes("JPEG"))

    async def analyze(body: Body, target: int):
        assert body.segment is not None and not segments.idle_count  # still lent while analysed
        if analysis_fails:
            raise RuntimeError("image process: boom")
        return await inline_analyze(body, target)
    producer = FakeProducer(fail_first=3)
    run = Run(fetched, producer=producer, analyze=analyze)
    sent = producer.send

    async def send_after_release(*args, **kwargs):
        assert fetched.body.segment is None and segments.idle_count == 1
        return await sent(*args, **kwargs)
    producer.send = send_after_release
    if analysis_fails:  # a bug (analyze never raises): the URL still ends, named by the exception
        await run()
        assert fetched.body.segment is None and segments.idle_count == 1
        assert [m["reason"] for m in run.producer.on(CRAWL_ERRORS_TOPIC)] == ["RuntimeError"]
    else:
        await run()
        assert len(run.producer.on(METADATA_TOPIC)) == 1
    segments.close()


@pytest.mark.parametrize("raised, ends", [(KeyError("a bug"), True), (SourceHalted(SOURCE), False),
                                           (ShuttingDown(SOURCE), False)])
async def test_an_unexpected_exception_ends_the_url_but_a_halt_or_a_stop_leaves_it_to_be_parked(
        raised: Exception, ends: bool, capsys) -> None:
    run = Run(ok(b""))
    run.fetcher.fetch = lambda url, source: _raise(raised)  # type: ignore[method-assign]
    if ends:
        await run()
        assert [(m["reason"], m["identifier"]) for m in run.producer.on(CRAWL_ERRORS_TOPIC)] == [("KeyError", "uuid-1")]
        assert not run.redis.store.get(status_window_key("status60s", SOURCE))  # not the site's doing
        assert '"task_crashed"' in capsys.readouterr().out
    else:
        with pytest.raises(type(raised)):
            await run()
        assert not run.outcomes()


async def _raise(exc: Exception):
    raise exc


def response_times(run: Run) -> dict[str, int]:
    """The response-time counts the outcome left, all buckets together (``response_ms:{source}:*``)."""
    counts: dict[str, int] = {}
    for key, fields in run.redis.store.items():
        if key.startswith(f"response_ms:{SOURCE}:"):
            for field, n in fields.items():
                counts[field] = counts.get(field, 0) + n
    return counts


@pytest.mark.parametrize("result, expected", [
    (ok(image_bytes("JPEG")), {str(bin_of(0.25)): 1}),
    (ok(b"", 503), {str(bin_of(0.25)): 1, OVERLOAD_FIELD: 1}),   # answered, and said it is overloaded
    (ok(b"", 500), {str(bin_of(0.25)): 1}),                      # one page's bug says nothing of load
    (ok(b"", 404), {str(bin_of(0.25)): 1}),
    (FetchError("Timeout"), {OVERLOAD_FIELD: 1}),                # no first byte to time
    (FetchError("ForbiddenAddress"), {}),                        # nothing reached the site
], ids=["200", "503", "500", "404", "timeout", "refused"])
async def test_each_answer_leaves_its_time_to_first_byte_for_the_back_off(result, expected) -> None:
    if isinstance(result, Fetched):
        result = Fetched(result.url, result.status, result.headers, result.body, 0.0, ttfb=0.25)
    run = await Run(result)()
    assert response_times(run) == expected


@pytest.mark.parametrize("body", [image_bytes("JPEG"), b"not an image"], ids=["image", "undecodable"])
async def test_an_answer_is_timed_for_the_back_off_before_the_image_pool_has_its_body(body: bytes) -> None:
    """The pool's queue is the worker's, not the site's: the back-off reads the answer's time as
    it came, and once."""
    seen: dict[str, int] = {}

    async def analyze(body: Body, target: int):
        seen.update(response_times(run))
        return await inline_analyze(body, target)
    fetched = ok(body)
    run = Run(Fetched(fetched.url, 200, fetched.headers, fetched.body, 0.0, ttfb=0.25), analyze=analyze)
    await run()
    assert seen == response_times(run) == {str(bin_of(0.25)): 1}


# --- A downstream refusing this one URL's output (issue 29) ---------------------------------
class RefusingThumbnails(FakeThumbnails):
    """The store refuses the first ``refuse`` uploads with ``error``."""

    def __init__(self, error: Exception, refuse: int = 1_000_000):
        super().__init__()
        self.error, self.refuse, self.calls = error, refuse, 0

    async def put(self, uuid: str, jpeg: bytes) -> None:
        self.calls += 1
        if self.calls <= self.refuse:
            raise self.error
        await super().put(uuid, jpeg)


class RefusingProducer(FakeProducer):
    """Kafka refuses every message to ``topics`` as too large."""

    def __init__(self, *topics: str):
        super().__init__()
        self.topics = topics

    async def send(self, topic: str, value: bytes, key=None, partition=None) -> None:
        if topic in self.topics:
            raise MessageRefused(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
        await super().send(topic, value, key, partition)


def logged(out: str, event: str) -> list[dict]:
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [line for line in lines if line["event"] == event]


async def test_a_thumbnail_the_store_refuses_ends_the_url_in_crawl_errors_at_once(capsys) -> None:
    """S3's 400 about this object is the URL's outcome, not an outage: no wait, no retry, and
    kept out of the breaker's windows (the site answered well)."""
    refused = ThumbnailRefused(400, "InvalidRequest", "Invalid Request")
    run = Run(ok(image_bytes("JPEG")), thumbnails=RefusingThumbnails(refused))
    await asyncio.wait_for(run(), 1.0)
    assert set(run.outcomes()) == {CRAWL_ERRORS_TOPIC}
    (error,) = run.producer.on(CRAWL_ERRORS_TOPIC)
    assert (error["reason"], error["status"], error["identifier"]) == ("ThumbnailRefused", 400, "uuid-1")
    assert run.redis.integer(errors_key(SOURCE, "ThumbnailRefused")) == 1 and run.last_statuses() == []
    out = capsys.readouterr().out
    assert logged(out, EVENT_INFRA_RETRY) == []
    (line,) = logged(out, EVENT_DOWNSTREAM_REFUSED)
    assert line["what"] == "s3_put" and line["identifier"] == "uuid-1" and "InvalidRequest" in line["error"]


async def test_a_store_wide_s3_failure_is_still_waited_out(monkeypatch) -> None:
    monkeypatch.setattr(task_module, "INFRA_RETRY_FIRST_DELAY", 0.01)
    thumbnails = RefusingThumbnails(S3PutFailed("HTTP 403 SignatureDoesNotMatch"), refuse=2)
    run = Run(ok(image_bytes("JPEG")), thumbnails=thumbnails)
    await run()
    assert set(run.outcomes()) == {METADATA_TOPIC} and "uuid-1" in run.thumbnails.stored


async def test_the_seconds_waiting_out_an_outage_are_not_the_tasks_work(monkeypatch) -> None:
    """What ``process`` returns sizes the source's share of the worker: counted as work, an S3
    outage parked the sources' URLs 1 s apart (test_s3_outage_mid_crawl_thumbnails_wait)."""
    monkeypatch.setattr(task_module, "INFRA_RETRY_FIRST_DELAY", 0.2)
    run = Run(ok(image_bytes("JPEG")), thumbnails=RefusingThumbnails(S3PutFailed("HTTP 503 SlowDown"), refuse=3))
    started = asyncio.get_running_loop().time()
    work = await run.task.process(run.request)
    assert asyncio.get_running_loop().time() - started >= 0.3  # waited 0.1-0.2, 0.2-0.4, 0.4-0.8 s
    assert 0 <= work < 0.1 and "uuid-1" in run.thumbnails.stored


@pytest.mark.parametrize("topic, result", [
    (METADATA_TOPIC, ok(exif_jpeg())),       # the EXIF message (or the quality message) too large
    (LINK_ROT_TOPIC, ok(b"", 404)),
    (INBOUND_TOPIC, ok(b"", 503)),           # the retry
])
async def test_a_message_kafka_refuses_ends_the_url_in_crawl_errors(topic: str, result: Fetched) -> None:
    run = Run(result, producer=RefusingProducer(topic))
    await asyncio.wait_for(run(), 1.0)
    assert set(run.outcomes()) == {CRAWL_ERRORS_TOPIC}
    (error,) = run.producer.on(CRAWL_ERRORS_TOPIC)
    assert (error["reason"], error["status"]) == ("MessageRefused", None)
    assert run.redis.integer(errors_key(SOURCE, "MessageRefused")) == 1


async def test_a_refused_crawl_errors_message_is_logged_whole_not_waited_on(capsys) -> None:
    run = Run(ok(b"", 403), producer=RefusingProducer(CRAWL_ERRORS_TOPIC))
    await asyncio.wait_for(run(), 1.0)
    (line,) = logged(capsys.readouterr().out, EVENT_OUTCOME_UNWRITABLE)
    assert (line["identifier"], line["url"], line["reason"]) == ("uuid-1", "http://example.org/a.jpg", "MessageRefused")
    assert run.redis.integer(errors_key(SOURCE, "MessageRefused")) == 1


async def test_a_redis_error_about_a_value_ends_the_url_and_one_about_the_server_is_waited_out(monkeypatch) -> None:
    monkeypatch.setattr(task_module, "INFRA_RETRY_FIRST_DELAY", 0.01)
    wrong_type = ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")
    run = await asyncio.wait_for(Run(ok(image_bytes("JPEG")), redis_down_for=1, outage=lambda _: wrong_type)(), 1.0)
    assert run.producer.on(CRAWL_ERRORS_TOPIC)[0]["reason"] == "RedisRefused"
    assert run.last_statuses() == ["RedisRefused"]  # a source whose state is broken is halted, not emptied
    for outage in (OutOfMemoryError, ReadOnlyError, lambda text: ResponseError(f"MISCONF {text}")):
        run = await Run(ok(image_bytes("JPEG")), redis_down_for=2, outage=outage)()
        assert set(run.outcomes()) == {METADATA_TOPIC}


@pytest.mark.parametrize("result, attempts, ended", [
    (ok(image_bytes("JPEG")), 0, 1),            # success
    (ok(b"", 404), 0, 1),                        # link rot
    (ok(b"", 403), 0, 1),                        # crawl_errors
    (FetchError("ForbiddenAddress"), 0, 1),      # crawl_errors, kept out of the windows
    (ok(b"", 503), 1, 1),                        # retries exhausted: crawl_errors
    (ok(b"", 503), 0, 0),                        # a retry is no end: it is still in the backlog
    (FetchError("RobotsUnavailable", retry_at=2e9), 0, 0),  # waiting for robots.txt: no end either
])
async def test_only_a_terminal_outcome_leaves_the_backlog(result, attempts: int, ended: int) -> None:
    """urls_ended:{source} (issue 26) counts each URL's one end, in the outcome's own pipeline."""
    run = await Run(result, attempts=attempts)()
    assert run.redis.integer(urls_ended_key(SOURCE)) == ended
