"""The names other systems depend on (SPEC.md §1, §2 and §4), in one place.

Operators type these Redis keys into ``redis-cli`` and downstream consumers
subscribe to these topics, so each name is written here once and imported
everywhere else; renaming one is a breaking change to SPEC.md.
"""
from __future__ import annotations

import json
import math
import re
import zlib
from urllib.parse import quote, unquote
from dataclasses import dataclass
from datetime import datetime, UTC
from collections.abc import Callable
from typing import Any

from common.hosts import InvalidHost, Origin, url_origin

# --- Kafka topics (SPEC.md §1) -------------------------------------------------
INBOUND_TOPIC = "inbound_images"
INBOUND_PARTITIONS = 4  # of inbound_images (and rejected_messages) where this project creates them
# Every source's URLs, in one keyed topic of URL_PARTITIONS partitions: a new source
# costs no topic and no rebalance. A source spreads over url_shards(its limit) partitions.
URLS_TOPIC = "urls"
METADATA_TOPIC = "image_metadata_updates"
LINK_ROT_TOPIC = "link_rot"
CRAWL_ERRORS_TOPIC = "crawl_errors"
REJECTED_TOPIC = "rejected_messages"
# A URL whose site opted out of being crawled by us (robots.txt, TDMRep, AI preferences,
# X-Robots-Tag): its own terminal outcome, with the signal and the value that decided it.
OPTED_OUT_TOPIC = "opted_out"
# Every terminal outcome's topic (SPEC.md §1): a reader of a crawl's results reads all of them.
OUTCOME_TOPICS = (METADATA_TOPIC, LINK_ROT_TOPIC, CRAWL_ERRORS_TOPIC, OPTED_OUT_TOPIC)
# URLs waiting for a time (worker.parking.wait_topics): for their host's robots.txt, or parked because their
# source cannot take them now (its queue in the worker is full, it is paused or backed off).
# One topic per length of wait, so each is in the order its messages fall due.
WAIT_TOPICS = ("urls_wait_30s", "urls_wait_5m", "urls_wait_1h")
# URLs of halted sources (``halted``, ``temp_halted`` too long): read again when a source resumes.
HALTED_URLS_TOPIC = "urls_halted"
# A halted-line scan's end in a partition of urls_halted: {"halted_scan": "<random id>"}, no URL.
SCAN_MARKER_FIELD = "halted_scan"
# The internal wait topics are light: a fixed number of partitions serves any fleet.
WAIT_TOPIC_PARTITIONS = 32

# Consumer groups: every worker shares one group so Kafka spreads partitions.
SPLITTER_GROUP = "crawl_monitor_splitter"
WORKER_GROUP = "image_crawler_workers"
WAIT_GROUP = "image_crawler_url_wait"
HALTED_GROUP = "image_crawler_halted"

# A source gets one partition per this many requests a second of its limit: a worker crawls
# one partition at most at its own speed, so a 200 req/s source needs several workers.
URL_RATE_PER_PARTITION = 25.0


def url_shards(limit: float | None) -> int:
    """How many partitions of ``urls`` a source of ``limit`` req/s spreads over (1 when unknown)."""
    if limit is None or not limit > 0 or math.isinf(limit):
        return 1
    return max(1, math.ceil(limit / URL_RATE_PER_PARTITION - 1e-9))


def url_partition(source: str, identifier: str, shards: int, partitions: int) -> int:
    """The partition of ``urls`` for one URL: the source's home partition (a stable hash of its
    name) and the shards after it, the identifier choosing among them (a retry keeps its place).
    Consecutive partitions, so a source's shards never collide with each other."""
    home = zlib.crc32(source.encode())
    shard = zlib.crc32(identifier.encode("utf-8", "surrogatepass")) % max(1, min(shards, partitions))
    return (home + shard) % partitions


# --- Redis keys (SPEC.md §2) -------------------------------------------------
INBOUND_SOURCES = "inbound_sources"
NUM_SPLIT = "num_split"
HALTED = "halted"
TEMP_HALTED = "temp_halted"
NUM_RESIZED = "num_resized"
RESIZE_ERRORS = "resize_errors"
LAST_50_LENGTH = 50
# Every per-source key that is state, not a counter, expires at most this long after the
# source's last request: a crawl of millions of sites must not keep them all.
SOURCE_STATE_TTL_SECONDS = 12 * 60 * 60

# status60s:{source}: one sorted-set member per request, the breaker's sliding minute.
MINUTE_WINDOW = "status60s"
MINUTE_WINDOW_SECONDS = 60
# status1hr / status12hr: counts per time bucket, a hash field "{bucket start}:{status}" -> count,
# so their size follows the statuses seen, not the request rate. prefix -> (window s, bucket s).
STATUS_COUNT_WINDOWS = {
    "status1hr": (60 * 60, 60),
    "status12hr": (12 * 60 * 60, 10 * 60),
}


def _keyed(prefix: str) -> Callable[[str], str]:
    """The key function of a per-source (or per-origin) key, ``{prefix}:{name}``."""
    def key(name: str) -> str:
        return f"{prefix}:{name}"
    return key


tokens_key = _keyed("currtokens")
override_rate_key = _keyed("override_rate")
last_50_key = _keyed("statuslast50req")
resized_key = _keyed(NUM_RESIZED)
# The statuses that have an errors_key(source, status) counter: read, never scanned for.
error_statuses_key = _keyed("error_statuses")


def status_window_key(prefix: str, source: str) -> str:
    return f"{prefix}:{source}"


def one_minute_window_key(source: str) -> str:
    return status_window_key(MINUTE_WINDOW, source)


def status_count_field(bucket_start: int, status: str) -> str:
    return f"{bucket_start}:{status}"


def bucket_of_field(field: str) -> int:
    """The bucket start a count window's field names; -1 for a field of another shape."""
    start = field.partition(":")[0]
    return int(start) if start.isdigit() else -1


def errors_key(source: str, status: str | None = None) -> str:
    return f"{RESIZE_ERRORS}:{source}" if status is None else f"{RESIZE_ERRORS}:{source}:{status}"


# Keys beyond the original's table (SPEC.md §2), owned by this project (politeness state).
retry_after_key = _keyed("retry_after")  # Unix time until which a 429/503 Retry-After pauses a source
robots_key = _keyed("robots")            # per origin
robots_lock_key = _keyed("robots_lock")
crawl_delay_key = _keyed("crawl_delay_next")
tdmrep_key = _keyed("tdmrep")            # per origin: its /.well-known/tdmrep.json, as robots:{origin}
tdmrep_lock_key = _keyed("tdmrep_lock")
# Opt-outs counted per signal (SPEC.md §2): hashes, field the signal, value the URLs it ended.
# Counters, like num_resized: the crawl's record of which sites opt out and how.
OPTED_OUT = "opted_out"
opted_out_key = _keyed(OPTED_OUT)
rate_limit_key = _keyed("rate_limit")    # the rate (req/s) the monitor grants a source now
source_requests_key = _keyed("num_requests")  # every request a worker makes, for achieved rates
# Held for 1/rate s after each request to a source, so the cluster's requests are evenly spaced
# (a bucket refilled once a second allows twice the rate within one second).
send_pace_key = _keyed("send_pace")
# The send times of a source's last floor(rate) + 1 requests (a list, newest first): a request
# goes only if the oldest of them is SEND_WINDOW_SECONDS old, so no second holds more.
sent_log_key = _keyed("sent_log")
# Held by the one active monitor (crawl_monitor.lease); its value names the holder.
MONITOR_LEASE = "monitor_lease"
# Adaptive back-off (crawl_monitor.adaptive): response times per source and time bucket
# (common.response_times), the monitor's verdict per source, and the operator's switch.
adaptive_key = _keyed("adaptive")           # hash: effective_rate, limit, ceiling, baseline_ms, recent_ms, ...
adaptive_off_key = _keyed("adaptive_off")   # set (any value): no adaptation for the source
# The field of adaptive:{source} holding the most the back-off may grant the source, req/s: its
# limit, or capacity discovery's ceiling (DISCOVERY_MAX_RATE) for a source that may discover;
# workers size a slow-starting source's queue and the spacing of its parked URLs by it (worker.scheduling.scheduler).
ADAPTIVE_CEILING_FIELD = "ceiling"
# The field holding the source's limit: its override, else the rate of its size (SPEC.md §3), req/s.
ADAPTIVE_LIMIT_FIELD = "limit"
ADAPTIVE_SLOW_START_FIELD = "slow_start"  # "1" while the source is in its slow start


def response_times_key(source: str, bucket_start: int) -> str:
    return f"response_ms:{source}:{bucket_start}"


# Sorted set: each source scored by the Unix time of its latest outcome or answer (workers ZADD
# with every outcome and every response time counted as it comes, nothing else). The monitor's
# per-second work reads only the sources it names as recent, so that work follows the sources being
# crawled, not every source ever seen.
ACTIVE_SOURCES = "active_sources"
# Sorted set: each source scored by the Unix time a task last waited for its tokens (workers,
# every ACTIVE_HEARTBEAT_SECONDS while one waits) or a URL of it was split. The regulator grants
# tokens to the sources recent here or in ACTIVE_SOURCES; the breaker and the back-off, which
# judge outcomes, read ACTIVE_SOURCES alone, so a waiting source costs them nothing.
WAITING_SOURCES = "waiting_sources"
# A source's backlog is urls_split - urls_ended: URLs split for the first time (a retry
# is not new) and URLs that reached their terminal outcome. Counters: they never expire.
urls_split_key = _keyed("urls_split")
urls_ended_key = _keyed("urls_ended")


# A partition's offsets finished (outcome or park acknowledged) above its commit: a sorted set,
# member and score the offset, written by the partition's consumer and trimmed below each commit it
# makes; its next owner skips them (worker.intake.finished_offsets). Kafka commits one position a partition, and
# the local broker drops commit metadata, so this is where "finished above the commit" is kept.


def finished_offsets_key(topic: str, partition: int) -> str:
    return f"finished_offsets:{topic}:{partition}"


# Statuses (the names in Redis and in crawl_errors' reason) live in common.statuses.

# URL lists (SPEC.md §2): the list producer publishes each derived source's count of URLs
# (its registrable domain's) here, and the monitor's regulator reads the rate of a source with no
# size in SOURCES_URL from it. A list's rows are counted once, however often it is resumed: the
# producer moves ``list_counted:{run}`` (the list's position counted so far) in the same script.
LIST_SOURCE_SIZES = "list_source_sizes"   # hash: source -> URLs of it in the lists produced
list_counted_key = _keyed("list_counted")  # string "{file index} {row}": counted up to there


# --- Log events (SPEC.md §4) -------------------------------------------------
EVENT_MONITORING_UPDATE = "monitoring_update"
EVENT_CRAWL_HALTED = "crawl_halted"
EVENT_CRAWL_RESUMED = "crawl_resumed"
EVENT_SOURCE_UNKNOWN = "source_unknown"
EVENT_RETRY_AFTER = "source_paused_retry_after"
# Worker-side politeness events.
EVENT_RETRY_AFTER_RECEIVED = "retry_after_received"
EVENT_ROBOTS_FETCHED = "robots_fetched"
EVENT_TDMREP_FETCHED = "tdmrep_fetched"
# The monitor's HTTP server.
EVENT_HTTP_API_STARTED = "http_api_started"
EVENT_HTTP_API_ERROR = "http_api_error"
# The monitor's own diagnostics and the TSV producer.
EVENT_MONITOR_STARTED = "monitor_started"
EVENT_MONITOR_STOPPED = "monitor_stopped"
EVENT_MONITOR_COMPONENT_ERROR = "monitor_component_error"
EVENT_MONITOR_STANDBY = "monitor_standby"
EVENT_MONITOR_LEASE_TAKEN = "monitor_lease_taken"
EVENT_SOURCES_LOADED = "sources_loaded"
EVENT_SOURCES_UNAVAILABLE = "sources_unavailable"
EVENT_REDIS_VALUE_IGNORED = "redis_value_ignored"
EVENT_MESSAGES_REJECTED = "messages_rejected"
EVENT_TSV_BAD_ROW = "tsv_bad_row"
EVENT_TSV_PRODUCED = "tsv_produced"
EVENT_CLOCK_SYNC_FAILED = "clock_sync_failed"  # Redis's TIME unread: the last offset stays
EVENT_KAFKA_CLIENT_ERROR = "kafka_client_error"  # librdkafka's own errors and warnings
EVENT_KAFKA_OFFSET_GAP = "kafka_offset_gap"  # a partition's offsets jumped and stayed so: believed
# The workers, the dev stack and the demo.
EVENT_COMMIT_FAILED = "commit_failed"
EVENT_CONSUMER_ERROR = "consumer_error"
EVENT_CONSUMER_FLOW_FAILED = "consumer_flow_failed"
EVENT_DEMO_INTERRUPTED = "demo_interrupted"
EVENT_DEVSTACK_READY = "devstack_ready"
EVENT_DEVSTACK_STOPPED = "devstack_stopped"
EVENT_DEVSTACK_STOPPING = "devstack_stopping"
EVENT_FETCH_UNEXPECTED_ERROR = "fetch_unexpected_error"
EVENT_IMAGE_POOL_BROKEN = "image_pool_broken"
EVENT_IMAGE_SHARED_MEMORY_UNAVAILABLE = "image_shared_memory_unavailable"
EVENT_INFRA_RETRY = "infra_retry"
# A downstream (S3, Kafka, Redis) refused one URL's object, message or value: it ends in crawl_errors.
EVENT_DOWNSTREAM_REFUSED = "downstream_refused"
EVENT_OUTCOME_UNWRITABLE = "outcome_unwritable"  # and its crawl_errors message was refused too
EVENT_STATS_REJECTED = "stats_rejected"
EVENT_TASK_CRASHED = "task_crashed"
EVENT_WORKER_DRAINING = "worker_draining"
EVENT_WORKER_METRICS_STARTED = "worker_metrics_started"
EVENT_WORKER_PARTITIONS = "worker_partitions"
EVENT_WORKER_REFRESH_FAILED = "worker_refresh_failed"
EVENT_FINISHED_RECORD_FAILED = "finished_record_failed"
EVENT_WORKER_STARTED = "worker_started"
EVENT_WORKER_STOPPED = "worker_stopped"
# A stop overran its bounds: every thread's stack follows on stderr and the worker exits 1.
EVENT_WORKER_STOP_OVERDUE = "worker_stop_overdue"
EVENT_WORKER_SUBSCRIBED = "worker_subscribed"
EVENT_WORKER_TOKENS_FORFEITED = "worker_tokens_forfeited"
# The worker is short of CPU while a fast source works: its slow sources' starts are limited (or no longer).
EVENT_WORKER_SLOW_SOURCES_HELD = "worker_slow_sources_held"
# Past MAX_QUEUED_URLS: what each partition left in Kafka and why, every few seconds (debug, for benches).
EVENT_WORKER_READING_TRACE = "worker_reading_trace"


# URL lists: the list producer and the exporter of results.
EVENT_LIST_BAD_ROW = "list_bad_row"
EVENT_LIST_STARTED = "list_started"
EVENT_LIST_PRODUCED = "list_produced"
EVENT_LIST_INTERRUPTED = "list_interrupted"
EVENT_EXPORT_SHARD = "export_shard_written"
EVENT_EXPORT_STOPPED = "export_stopped"
EVENT_EXPORT_GAP = "export_gap"
# The dataset collector (url_lists.dataset): a shard published whole; the sites' limits
# not readable from Redis (the summary's rate line goes without); a broker that cannot find
# offsets by time (a fresh run then reads the outcome topics from their start).
EVENT_DATASET_SHARD = "dataset_shard_written"
EVENT_DATASET_LIMITS_UNREADABLE = "dataset_limits_unreadable"
EVENT_DATASET_OFFSETS_BY_TIME = "dataset_offsets_by_time_unavailable"
# The one-command crawl (url_lists.crawl): started (or resumed), a part of it failed, stopped.
EVENT_LIST_CRAWL_STARTED = "list_crawl_started"
EVENT_LIST_CRAWL_FAILED = "list_crawl_failed"
EVENT_LIST_CRAWL_STOPPED = "list_crawl_stopped"


# Events whose shape SPEC.md §4 fixes exactly: their lines carry no "level" (it is implied).
FIXED_SHAPE_EVENTS = frozenset({EVENT_MONITORING_UPDATE, EVENT_CRAWL_HALTED})
# Each event's level (logging's numbers); an event not named here is INFO.
_DEBUG, _WARNING, _ERROR = 10, 30, 40
EVENT_LEVELS = {
    EVENT_WORKER_READING_TRACE: _DEBUG,
    EVENT_CRAWL_HALTED: _WARNING, EVENT_SOURCE_UNKNOWN: _WARNING, EVENT_RETRY_AFTER: _WARNING,
    EVENT_SOURCES_UNAVAILABLE: _WARNING, EVENT_REDIS_VALUE_IGNORED: _WARNING,
    EVENT_MESSAGES_REJECTED: _WARNING, EVENT_TSV_BAD_ROW: _WARNING, EVENT_LIST_BAD_ROW: _WARNING,
    EVENT_LIST_INTERRUPTED: _WARNING, EVENT_EXPORT_GAP: _WARNING, EVENT_KAFKA_CLIENT_ERROR: _WARNING,
    EVENT_KAFKA_OFFSET_GAP: _WARNING, EVENT_CLOCK_SYNC_FAILED: _WARNING,
    EVENT_DATASET_LIMITS_UNREADABLE: _WARNING, EVENT_DATASET_OFFSETS_BY_TIME: _WARNING,
    EVENT_INFRA_RETRY: _WARNING, EVENT_WORKER_TOKENS_FORFEITED: _WARNING, EVENT_DOWNSTREAM_REFUSED: _WARNING,
    EVENT_WORKER_REFRESH_FAILED: _WARNING, EVENT_FINISHED_RECORD_FAILED: _WARNING, EVENT_COMMIT_FAILED: _WARNING,
    EVENT_CONSUMER_FLOW_FAILED: _WARNING, EVENT_STATS_REJECTED: _WARNING,
    EVENT_IMAGE_SHARED_MEMORY_UNAVAILABLE: _WARNING,
    EVENT_LIST_CRAWL_FAILED: _ERROR,
    EVENT_MONITOR_COMPONENT_ERROR: _ERROR, EVENT_HTTP_API_ERROR: _ERROR, EVENT_TASK_CRASHED: _ERROR,
    EVENT_FETCH_UNEXPECTED_ERROR: _ERROR, EVENT_IMAGE_POOL_BROKEN: _ERROR, EVENT_CONSUMER_ERROR: _ERROR,
    EVENT_OUTCOME_UNWRITABLE: _ERROR, EVENT_WORKER_STOP_OVERDUE: _ERROR,
}

def utc_now_iso() -> str:
    return datetime.now(UTC).isoformat()


# --- Inbound message validation (SPEC.md §1) -------------------------------
MAX_URL_LENGTH = 2048
MAX_REJECTED_RAW_BYTES = 4096
_SOURCE_RE = re.compile(r"^[a-z0-9_.-]+$")
MAX_SOURCE_LENGTH = 200  # a topic name may be at most 249 characters


MAX_UUID_LENGTH = 200  # it names the thumbnail's S3 key
_WHITESPACE_OR_CONTROL = re.compile("[\x00-\x20\x7f]")  # one search: a loop over characters cost 10 µs a URL

# --- Thumbnail keys (SPEC.md §5, "Thumbnails") --------------------------------
THUMBNAIL_SUFFIX = ".jpg"
# The escape that stands for percent-encoding's "%": "!" is kept by every URL parser and store
# as it is, and no store or proxy decodes it a second time (a "%2F" decoded twice is a "/").
KEY_ESCAPE = "!"
# The longest key every store takes: AWS allows 1,024 bytes, but a store that keeps objects as
# files (SeaweedFS's filer, MinIO) allows 255 bytes per path component, and the key has one.
MAX_KEY_BYTES = 255


def thumbnail_key(identifier: str) -> str:
    """The S3 key of ``identifier``'s thumbnail in S3_BUCKET: its UTF-8 percent-encoded by the
    standard library (only ``A-Z a-z 0-9 _ . - ~`` kept), with ``!`` written for ``%``, then
    ``.jpg``.

    Why this shape: the key holds no ``/``, ``\\``, ``%``, ``?``, ``#`` or non-ASCII character, so
    no store, proxy or URL parser can read a path segment, a dot segment or a look-alike in it,
    and it never leaves the bucket; percent-encoding is one-to-one and ``!`` is always escaped
    (``%21`` becomes ``!21``), so two identifiers never share a key; and a UUID is all kept
    characters, so it keeps ``{uuid}.jpg``, which downstream systems rely on.
    """
    return quote(identifier, safe="").replace("%", KEY_ESCAPE) + THUMBNAIL_SUFFIX


def identifier_of_key(key: str) -> str:
    """The identifier whose thumbnail ``key`` is (the inverse of ``thumbnail_key``)."""
    if not key.endswith(THUMBNAIL_SUFFIX):
        raise ValueError(f"not a thumbnail key: {key[:200]!r}")
    return unquote(key[:-len(THUMBNAIL_SUFFIX)].replace(KEY_ESCAPE, "%"), errors="strict")


def _encodable(text: str) -> bool:
    """JSON may carry lone surrogates that no UTF-8 consumer (S3, Kafka) accepts."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


class InvalidMessage(ValueError):
    """An inbound message that cannot be crawled; its text is the reason given."""


ROBOTS_WAIT_FIELD = "robots_wait_since"      # when the URL's host's robots.txt was first unavailable
RETRY_AFTER_WAIT_FIELD = "retry_after_since"  # when the URL was first answered 429 or 503 (a Retry-After pause)


@dataclass(frozen=True, slots=True)
class CrawlRequest:
    url: str
    uuid: str
    source: str
    attempts: int = 0
    # Unix time robots.txt of the URL's host was first found unavailable; None: never.
    robots_wait_since: float | None = None
    # Unix time the URL was first answered 429 or 503, which pause its source; None: never.
    retry_after_since: float | None = None

    def waits(self) -> dict[str, float]:
        """The waits this URL went through, as the fields its messages carry (SPEC.md §1)."""
        found = {ROBOTS_WAIT_FIELD: self.robots_wait_since, RETRY_AFTER_WAIT_FIELD: self.retry_after_since}
        return {name: since for name, since in found.items() if since is not None}

    def to_json(self, **extra: Any) -> bytes:
        fields: dict[str, Any] = {"url": self.url, "uuid": self.uuid, "source": self.source,
                                  "attempts": self.attempts, **self.waits()}
        return json.dumps({**fields, **extra}).encode()


def validate_url(url: Any) -> str:
    url_checked_origin(url)
    return url


def url_checked_origin(url: Any) -> Origin:
    """The origin of a valid inbound ``url`` (SPEC.md §1); InvalidMessage with the reason otherwise."""
    check_url_text(url)
    try:
        return url_origin(url)  # the host every later reader of this URL will see, or none
    except InvalidHost as exc:
        raise InvalidMessage(str(exc)) from None


def check_url_text(url: Any) -> str:
    """The checks of an inbound ``url`` that do not read its host (SPEC.md §1)."""
    if not isinstance(url, str) or not url:
        raise InvalidMessage("url must be a non-empty string")
    if len(url) >= MAX_URL_LENGTH:
        raise InvalidMessage(f"url is {len(url)} characters; the limit is under {MAX_URL_LENGTH}")
    if _WHITESPACE_OR_CONTROL.search(url) or not _encodable(url):
        raise InvalidMessage("url contains whitespace, control characters or invalid UTF-8")
    return url


def validate_uuid(uuid: Any) -> str:
    if not isinstance(uuid, str) or not uuid.strip():
        raise InvalidMessage("uuid must be a non-empty string")
    if len(uuid) > MAX_UUID_LENGTH or not uuid.isprintable() or not _encodable(uuid):
        raise InvalidMessage(f"uuid must be printable UTF-8 of at most {MAX_UUID_LENGTH} characters")
    key_bytes = len(thumbnail_key(uuid))  # ASCII: characters are bytes
    if key_bytes > MAX_KEY_BYTES:
        raise InvalidMessage(f"uuid's thumbnail key would be {key_bytes} bytes, past {MAX_KEY_BYTES} (each "
                             "character but A-Z a-z 0-9 _ . - ~ takes 3 per UTF-8 byte)")
    return uuid


def validate_source(source: Any) -> str:
    """The source name, lower-cased as the splitter names it."""
    if not isinstance(source, str):
        raise InvalidMessage("source must be a string")
    source = source.lower()
    if not _SOURCE_RE.match(source) or len(source) > MAX_SOURCE_LENGTH:
        raise InvalidMessage(f"source {source[:80]!r} must match [a-z0-9_.-]+ (at most {MAX_SOURCE_LENGTH})")
    return source


def parse_crawl_request(raw: bytes | str | None) -> CrawlRequest:
    """Parse and validate an ``inbound_images`` / ``urls`` message.

    Raises InvalidMessage with a reason fit for ``rejected_messages``.
    """
    if raw is None:
        raise InvalidMessage("message has no value")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InvalidMessage(f"not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    return crawl_request(data)


def crawl_request(data: Any) -> CrawlRequest:
    """Validate a crawl request whose JSON is already decoded (``parse_crawl_request`` without
    the decoding): the same request, or the same InvalidMessage."""
    if not isinstance(data, dict):
        raise InvalidMessage(f"expected a JSON object, got {type(data).__name__}")
    url = validate_url(data.get("url"))
    uuid = validate_uuid(data.get("uuid"))
    source = validate_source(data.get("source"))
    attempts = data.get("attempts", 0)
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 0:
        raise InvalidMessage("attempts must be a non-negative integer")
    waits: dict[str, float | None] = {}
    for field in (ROBOTS_WAIT_FIELD, RETRY_AFTER_WAIT_FIELD):
        since = data.get(field)
        if since is not None and not _unix_time(since):
            raise InvalidMessage(f"{field} must be a Unix time in seconds")
        waits[field] = None if since is None else float(since)
    return CrawlRequest(url=url, uuid=uuid, source=source, attempts=attempts,
                        robots_wait_since=waits[ROBOTS_WAIT_FIELD], retry_after_since=waits[RETRY_AFTER_WAIT_FIELD])


def _unix_time(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 <= value < 1e11


# --- Outbound message shapes (SPEC.md §1) -------------------------------------
def rejected_message(topic: str, raw: bytes | None, error: str) -> bytes:
    text = (raw or b"")[:MAX_REJECTED_RAW_BYTES].decode("utf-8", errors="replace")
    return json.dumps({"topic": topic, "raw": text, "error": error, "time": utc_now_iso()}).encode()


def link_rot_message(identifier: str) -> bytes:
    return json.dumps({"identifier": identifier, "time": utc_now_iso()}).encode()


def crawl_error_message(request: CrawlRequest, reason: str, status: int | None) -> bytes:
    return json.dumps({
        "identifier": request.uuid, "url": request.url, "source": request.source,
        "reason": reason, "status": status, "attempts": request.attempts,
        "time": utc_now_iso(),
    }).encode()


def quality_message(identifier: str, width: int, height: int,
                    compression_quality: int | None, filesize: int, **extra: Any) -> bytes:
    return json.dumps({
        "identifier": identifier, "width": width, "height": height,
        "compression_quality": compression_quality, "filesize": filesize, **extra,
    }).encode()


# The signals an opted_out message names (SPEC.md §1).
SIGNAL_ROBOTS = "robots-txt"                      # robots.txt, our product token's group
SIGNAL_ROBOTS_EXTRA = "robots-txt-extra-token"    # robots.txt, a group of ROBOTS_EXTRA_TOKENS
SIGNAL_ROBOTS_CONTENT_USAGE = "robots-content-usage"  # a Content-Usage rule of robots.txt
SIGNAL_TDMREP_FILE = "tdmrep-file"                # /.well-known/tdmrep.json
SIGNAL_TDMREP_HEADER = "tdmrep-header"            # a tdm-reservation: 1 response header
SIGNAL_X_ROBOTS_TAG = "x-robots-tag"              # an X-Robots-Tag directive (noai, noimageai)
SIGNAL_CONTENT_USAGE_HEADER = "content-usage-header"  # a Content-Usage response header
SIGNALS = (SIGNAL_ROBOTS, SIGNAL_ROBOTS_EXTRA, SIGNAL_ROBOTS_CONTENT_USAGE, SIGNAL_TDMREP_FILE,
           SIGNAL_TDMREP_HEADER, SIGNAL_X_ROBOTS_TAG, SIGNAL_CONTENT_USAGE_HEADER)
MAX_DECISION_VALUE = 300  # characters of the value that decided it: a header may be enormous


def opted_out_message(request: CrawlRequest, signal: str, value: str, status: int | None) -> bytes:
    """``status``: the HTTP status of the response whose headers opted out; None when the URL was
    never requested (a rule known before the request)."""
    return json.dumps({
        "identifier": request.uuid, "url": request.url, "source": request.source,
        "signal": signal, "value": value[:MAX_DECISION_VALUE], "status": status,
        "time": utc_now_iso(),
    }).encode()


def exif_message(identifier: str, exif: dict[str, Any]) -> bytes:
    return json.dumps({"identifier": identifier, "exif": exif}).encode()


def allowed_per_second(limit: float) -> int:
    """The most requests of a source a site may see in any sliding one-second window at a
    limit of ``limit`` req/s: floor(limit) + 1, the promise of README's "Politeness" (the
    send log of ``worker.fetching.tokens`` keeps this many; the sites' checks allow this many)."""
    return math.floor(limit + 1e-9) + 1  # 3.0 given as 2.9999999999 is still 3
