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
# Sizes counted by the list producer (list_source_sizes) are re-read this often; a source
# new to the regulator is looked up at once.
LIST_SIZES_REFRESH_SECONDS = 30.0
SOURCES_RETRY_SECONDS = 60          # after a failed refresh; the last known rates stay meanwhile
SOURCES_FETCH_TIMEOUT = 30.0

# --- Token buckets.
TICK_SECONDS = 1.0
# A bucket outlives its tick by half a second only: a dead monitor leaves no
# tokens behind within 2 s, and a worker's DECR on the missing key reads -1
# (fail closed). The cost: a tick more than 0.5 s late pauses the crawl briefly.
BUCKET_TTL_MS = 1500
RATE_LIMIT_TTL_SECONDS = 10
RATE_LIMIT_REWRITE_SECONDS = 5.0    # an unchanged rate_limit:{source} is written again this often (half its life)
REFILL_BATCH = 500                  # sources per pipeline of bucket writes (two SETs each)
MAX_RETRY_AFTER_SECONDS = 60 * 60   # a Retry-After further away than this is capped
UNKNOWN_SOURCE_REPORT_SECONDS = 5 * 60

# --- Circuit breaker (SPEC.md §3).
BREAKER_CHECK_SECONDS = 1.0
BREAKER_FULL_PASS_SECONDS = 10.0  # between these, a check reads only sources with new outcomes
TEMP_HALT_ERROR_RATIO = 0.10          # the minute's error share must be above this, the operator's threshold...
TEMP_HALT_HEALTHY_ERROR_RATIO = 0.03  # ... and its errors more than a site failing this share (room over 2%)...
TEMP_HALT_FALSE_ALARM = 0.002         # ... shows this rarely: the largest that asks 8 of a 1 req/s minute's ~61
TEMP_HALT_MIN_SAMPLES = 10            # fewer answers say too little; 10 still halt a 50% site in seconds at 1 req/s
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

# --- Adaptive back-off (crawl_monitor.adaptive; docs/decisions.md, "Adaptive back-off").
ADAPTIVE_FLOOR_RPS = 1.0         # adaptation never takes a source below this (nor above its limit)
ADAPTIVE_START_SHARE = 0.1       # a source new to the monitor starts at this share of its limit...
ADAPTIVE_DISCOVERY_START_SHARE = 0.2  # ... one that may discover past it, at this share of its discovery ceiling...
ADAPTIVE_SLOW_START_SAMPLES = 3  # ... doubles each time this many fresh answers are as fast as at first
ADAPTIVE_ANSWER_LAG_SECONDS = 0.25  # ... counting answers recorded this long (plus the site's time) after
                                    # the change: a worker records one after its image work and upload
ADAPTIVE_DISCOVERY_SAMPLES = 4   # past its limit (discovery) a doubling needs this many fresh answers...
ADAPTIVE_DISCOVERY_SECONDS = 0.9  # ... to requests sent over a look (each second, give or take) at the current grant
ADAPTIVE_DECREASE = 0.7          # x this when responses slow down past the slow start
ADAPTIVE_DRAIN_SHARE = 0.5       # a slow start that overran its site: this share of what the site served, while
                                 # the queue it built drains...
ADAPTIVE_DRAIN_QUANTILE = 0.9    # ... (the queue's delay: this quantile of the slow answers' times)...
ADAPTIVE_DRAIN_MAX_SECONDS = 30.0  # ... for at most this long (the workers' per-host cap bounds the queue)...
ADAPTIVE_DRAINED_FACTOR = 1.2    # ... or until answers to requests made during it are within this x the baseline...
ADAPTIVE_DRAINED_MIN_EXTRA_MS = 20.0  # ... or this much above it: nothing waited ahead of them
ADAPTIVE_LAND_SHARE = 0.9        # ... then this share of it (docs/decisions.md, "Capacity discovery")
ADAPTIVE_STEP_RPS = 1.0          # after the first slow-down it climbs back by the larger of these
ADAPTIVE_STEP_SHARE = 0.02       # ... (share of the limit) per judged bucket
ADAPTIVE_MIN_SAMPLES = 10        # responses a verdict needs (merged over buckets for a slow source)
ADAPTIVE_SLOW_FACTOR = 2.0       # slowed: the recent median above this times the baseline
ADAPTIVE_SLOW_MIN_EXTRA_MS = 100.0   # ... and at least this much above it (loopback noise is not load)
ADAPTIVE_RECOVERED_FACTOR = 1.5  # recovered: at most this times the baseline
ADAPTIVE_RECOVERED_MIN_EXTRA_MS = 50.0  # ... or at most this much above it
ADAPTIVE_OVERLOAD_SHARE = 0.05   # timeouts, 429/502/503/504 above this share slow it down too
ADAPTIVE_OVERLOAD_MIN = 2        # ... counting at least this many
ADAPTIVE_BASELINE_DOUBLING_SECONDS = 300.0  # the baseline drifts up so, unless a faster median resets it
ADAPTIVE_READINGS_KEPT = 30      # response buckets remembered per source (a minute)
ADAPTIVE_READ_GRACE_SECONDS = 1.0  # a bucket is read this long after it ends: outcomes come in late
ADAPTIVE_STATE_TTL_SECONDS = 3600  # adaptive:{source} outlives a monitor's restart, not a quiet hour
ADAPTIVE_STATE_RENEW_SECONDS = 60.0  # an unchanged state is written again (its expiry renewed) at most this often
# active_sources (crawl_monitor.active_sources): members quiet this long are dropped.
ACTIVE_SOURCES_KEPT_SECONDS = 24 * 3600
# How far before its last look a reader asks for recent sources: workers score an outcome by
# Redis's clock (common.redis_clock), as the monitor reads it, but a worker's score may land a
# round trip (and a late event loop) after the time it carries.
ACTIVE_SOURCES_SLACK_SECONDS = 1.0
# The dashboard re-reads the quiet sources it shows this often (active ones each time).
ACTIVE_SOURCES_FULL_READ_SECONDS = 60.0
# The regulator grants tokens to the sources active this recently (and to no other).
# Workers score a source while a task waits for its tokens (worker.constants.
# ACTIVE_HEARTBEAT_SECONDS, 2 s, at a peek at most TOKEN_POLL_MAX later), so a slow or paused
# source with work stays in, with ACTIVE_SOURCES_SLACK_SECONDS to spare, while one with nothing
# to crawl drops out within seconds and its keys expire: the monitor's work per URL follows
# the seconds its source waits, and a one-URL site is ticked ~5 times (docs/decisions.md).
ACTIVE_SOURCES_TICK_SECONDS = 4.0
# The adaptive back-off's second reads the sources the regulator asked about this recently
# (a few of its ticks); one not asked about for ADAPTIVE_FORGET_SECONDS is forgotten (its
# state waits in adaptive:{source}, restored when it comes back).
ADAPTIVE_ASKED_SECONDS = 5.0
ADAPTIVE_FORGET_SECONDS = 600.0
# The dashboard and /metrics show the sources active this recently, and the halted and paused.
SHOWN_RECENT_SECONDS = 600.0
# One monitoring_update line lists at most this many sources (halted and paused ones first,
# then the most recently active) and at most MONITORING_SPECIFIC_BYTES of them; the rest are
# counted (general.sources_total, sources_listed), so a line stays under 256 KiB.
MONITORING_MAX_LISTED = 500
MONITORING_SPECIFIC_BYTES = 160 * 1024
MONITORING_TRIPPED_BYTES = 64 * 1024  # general.circuit_breaker_tripped: names up to this size

