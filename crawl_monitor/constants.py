"""The monitor's tunables, in one place so that a policy change is a one-line diff.

Names (topics, Redis keys, log events) live in ``common.contracts``; this
module holds only the numbers.
"""
from __future__ import annotations

# --- Computed rate (SPEC.md §3): linear between two (images, req/s) points, clamped.
SMALL_SOURCE_IMAGES = 5_000
SMALL_SOURCE_RATE = 1.0
LARGE_SOURCE_IMAGES = 500_000_000
LARGE_SOURCE_RATE = 200.0

SOURCES_REFRESH_SECONDS = 30 * 60
SOURCES_RETRY_SECONDS = 60          # after a failed refresh; the last known rates stay meanwhile
SOURCES_FETCH_TIMEOUT = 30.0

# --- Token buckets.
TICK_SECONDS = 1.0
# A bucket outlives its tick by half a second only: a dead monitor leaves no
# tokens behind within 2 s, and a worker's DECR on the missing key reads -1
# (fail closed). The cost: a tick more than 0.5 s late pauses the crawl briefly.
BUCKET_TTL_MS = 1500
RATE_LIMIT_TTL_SECONDS = 10
REFILL_BATCH = 500                  # sources per pipeline of bucket writes (two SETs each)
MAX_RETRY_AFTER_SECONDS = 60 * 60   # a Retry-After further away than this is capped
UNKNOWN_SOURCE_REPORT_SECONDS = 5 * 60

# --- Circuit breaker (SPEC.md §3).
BREAKER_CHECK_SECONDS = 1.0
TEMP_HALT_ERROR_RATIO = 0.10        # strictly more than this halts
TEMP_HALT_MIN_SAMPLES = 10          # fewer requests in the minute say too little to judge
TEMP_HALT_WINDOW_SECONDS = 60
BUCKET_TRIM_SECONDS = 60  # how often the hour and twelve-hour count windows drop old buckets

# --- Monitoring log (SPEC.md §4).
MONITORING_INTERVAL_SECONDS = 5.0

# --- One active monitor (crawl_monitor.lease): a standby takes over this long after a crash.
LEASE_TTL_MS = 5000
LEASE_RENEW_SECONDS = 1.0

# --- Redis: the components' calls are few and pipelined; past this many at once a call waits.
REDIS_MAX_CONNECTIONS = 16

# --- Splitter.
SPLIT_BATCH_SIZE = 5_000            # one flush and one commit per batch: the throughput lever
SPLIT_POLL_SECONDS = 0.5
SPLIT_FLUSH_SECONDS = 10.0
SPLIT_MAX_BACKOFF_SECONDS = 30.0
SPLIT_PARTITION_CHECK_SECONDS = 60.0  # how soon partitions an operator adds to inbound_images are read
TOPIC_CREATE_BATCH = 500            # new source topics per CreateTopics request (a stop is checked between two)
