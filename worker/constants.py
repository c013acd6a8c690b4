"""The worker's tuning knobs, grouped by the room that reads them; one line of what each is.

Settings an operator changes per deployment live in ``common.settings``; these are the
engineering defaults behind them. The numbers behind a choice are in docs/decisions.md.
"""
from __future__ import annotations

# --- Intake: reading urls and committing (worker/intake/) ---------------------------------
POLL_BATCH = 500                   # messages per consumer poll
POLL_TIMEOUT = 0.1                 # seconds a poll may wait for messages
COMMIT_INTERVAL = 1.0              # seconds between offset commits
OFFER_INTERVAL = 0.1               # seconds between positions offered for a revocation's commit
ASSIGN_OFFSETS_TIMEOUT = 30.0      # seconds for the committed offsets of newly assigned partitions
FINISHED_FLUSH_INTERVAL = 0.2      # seconds between writes of the finished offsets above a commit (lost in a crash)
FINISHED_OFFSETS_TTL = 7 * 24 * 3600  # seconds a partition's finished offsets are kept after their last write
FINISHED_OFFSETS_BUFFER = 100_000  # finished offsets held at most while Redis does not answer
CONSUMER_EXTRA_CONFIG = {
    # Round-robin, eager: the subscription never changes, so only a worker joining or leaving rebalances.
    "partition.assignment.strategy": "roundrobin",
    # librdkafka's prefetch per consumer, held beside what the worker holds (docs/decisions.md, "Fleet scale").
    "queued.max.messages.kbytes": 1024,
}

# --- Scheduling: queues, slots and starts (worker/scheduling/) ----------------------------
REFRESH_INTERVAL = 2.0             # seconds between reads of halts and rates
NEW_SOURCE_REFRESH = 0.2           # seconds before a source new to this worker has its rate read
REALLOCATE_INTERVAL = 0.1          # seconds between two passes that size every working source's slots
FORGET_ABOVE = 2000                # idle sources' state is dropped past twice the working ones plus this
MIN_TASKS_PER_SOURCE = 1           # the shared floor of every source: one task at a time
CONCURRENCY_HEADROOM = 2.0         # slots reserved for a source: pace x latency x this, at most its URLs here
DEFAULT_LATENCY = 1.0              # seconds a task is assumed to take before any is observed
LATENCY_SMOOTHING = 0.2            # weight of a new sample in a source's latency average
QUEUE_SECONDS = 5.0                # a source's queue holds this many seconds of its pace; the rest are parked
QUEUE_UNRATED = 1000               # URLs queued of a source whose rate is not read yet (trimmed once it is)
QUEUE_MAX_PER_SOURCE = 5000        # URLs queued at most for any source, whatever its rate
HEAD_START_MAX_SECONDS = 10.0      # most of a source's queue, in seconds at its pace, its images skip in the pool
THROUGHPUT_SMOOTHING = 0.5         # weight of a refresh's measure in a source's throughput here
THROUGHPUT_WARMUP_SECONDS = 5.0    # a source's first seconds of work here are not measured
SLOW_PARTITIONS_PAUSE_AT = 0.75    # share of MAX_QUEUED_URLS past which partitions feeding no fast source pause
# Past MAX_QUEUED_URLS, only fast sources' URLs are taken; the rest are left in Kafka (worker/intake/read_ahead.py):
FAST_ROOM = 0.1                    # share of MAX_QUEUED_URLS kept for fast sources' URLs: the others stop at the rest
READ_AHEAD_MAX = 5000              # records a partition leaves in Kafka past the bound, at most, before it pauses
LOOKUP_INTERVAL = 0.2              # seconds between look-ups of the rates of sources read past the bound, unknown here
LOOKUP_MAX = 2000                  # sources waiting for that look-up, at most (the others: when read again)
FAST_LEARNED_MAX = 1000            # fast sources learned by a look-up, kept at most
LEARNED_SECONDS = 10.0             # how long a look-up's answer is trusted
REWIND_INTERVAL = 1.0              # seconds between two readings again of a partition for its fast sources, at least
REREAD_SECONDS = 10.0              # past the bound, every partition is read again from what it left this often
TRACE_SECONDS = 5.0                # how often that reading is traced while records are left (a debug event)
# Fast sources first while the worker is short of CPU (docs/decisions.md, "One keyed urls topic, and parking"):
FAST_SOURCE_RATE = 5.0             # req/s from which a source is fast: it needs a token every 200 ms or less
LOOP_LAG_PROBE_SECONDS = 0.02      # how often a timer measures the event loop's delay
LOOP_LAG_TARGET = 0.01             # seconds of mean delay above which the slow sources' starts fall
ADMISSION_UPDATE_SECONDS = 1.0     # how often the slow sources' allowance is adjusted
SLOW_STARTS_DECREASE = 0.7         # factor on the allowance for each late second
SLOW_STARTS_INCREASE = 1.1         # factor (and +1) on it for each second on time
SLOW_STARTS_FLOOR = 2.0            # slow starts a second never held below this
SLOW_SHARE = 0.25                  # nor below this share of the tasks ended a second (or the slow paces' sum)
SLOW_STARTS_BURST_SECONDS = 0.25   # seconds of allowance saved up at most
ADMISSION_REPORT_SECONDS = 10.0    # a worker_slow_sources_held line at most this often while limited

# --- Parking: URLs waiting in Kafka (worker/parking/) -------------------------------------
WAIT_TIER_SECONDS = (30.0, 300.0, 3600.0)  # a turn's length in each wait topic; a wait takes the longest it covers
WAIT_POLL_SECONDS = 0.5            # how late past its time a waiting URL may be handed back
WAIT_HELD_PER_PARTITION = 500      # records of a wait partition held at most, any of them handed over when due
PARK_DEFAULT_SECONDS = 30.0        # wait of a URL whose source is paused (rate 0) or temporarily halted
PARK_UNJUDGED_SECONDS = 5.0        # wait of a URL whose source the monitor has not judged yet
PARK_TRUST_SECONDS = WAIT_TIER_SECONDS[0]  # how far ahead a source held below its pace is placed
# A URL parked for its source's turn is written to come back this much before it: the wait line hands
# it over up to WAIT_POLL_SECONDS late, and it reaches a queue through urls up to ~0.35 s after that
# (docs/decisions.md, "Pacing: a parked URL comes back ahead of its turn"); on time, its queue ran dry meanwhile.
PARK_RETURN_LEAD_SECONDS = 1.0
HALTED_RESCAN_SECONDS = 600.0      # the halted line reads urls_halted at least this often
HALTED_RESUME_GRACE_SECONDS = 20.0  # after a resume, it scans again for this long (others see it later)...
HALTED_RESUME_RESCAN_SECONDS = 5.0  # ... this often

# --- Fetching: tokens (worker/fetching/tokens.py; docs/decisions.md, "Pacing") --------------
TOKEN_TURN_RATE = 20.0             # req/s of a source's rate per turn of tasks waiting for its tokens
TOKEN_POLL_MIN = 0.05              # seconds between polls of an empty bucket, at the fastest...
TOKEN_POLL_MAX = 0.25              # ... and at the slowest (else 1/rate)
TOKEN_PEEK_INTERVAL = 0.01         # seconds between the waiting sources' shared MGETs
ACTIVE_HEARTBEAT_SECONDS = 2.0     # a waiting source is scored in waiting_sources this often
TOKENS_FORGET_SECONDS = 120.0      # a source no task asked tokens for in this long is forgotten
TOKENS_FORGET_CHECK_SECONDS = 10.0  # ... checked this often (docs/decisions.md, "Fleet scale")
PACE_CATCH_UP_SECONDS = 0.05       # how far ahead of its even slot a request may go (a late worker catches up)
SEND_WINDOW_SECONDS = 1.05         # floor(rate) + 1 sends of a source at least this far apart
SEND_LOG_MAX = 1000                # sends logged at most (higher rates held over a shorter window)
ARRIVAL_JITTER_SECONDS = 0.02      # the way to the site's share of a token's tolerated lateness
STALE_TOKEN_SECONDS = 0.03         # a token answered this much later than the fastest answers is forfeited
TOKEN_ANSWER_SMOOTHING = 0.01      # the fastest answers' low quantile climbs by this share of a slower one
FORFEIT_REPORT_SECONDS = 60.0      # at most one worker_tokens_forfeited line a minute

# --- Fetching: HTTP (worker/fetching/fetch.py, http_client.py, shared_memory.py) -------------
CONNECT_TIMEOUT = 10.0             # seconds to open a connection
READ_TIMEOUT = 30.0                # seconds of silence on an open connection
TOTAL_TIMEOUT = 90.0               # seconds for one hop, headers and body
MAX_REDIRECTS = 5                  # redirect hops followed at most
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})  # statuses followed as redirects
SEGMENT_STEP = 1 << 20             # a body's shared-memory segment is backed this much at a time
IDLE_SEGMENT_BYTES = 128 << 20     # backed memory of idle segments kept for reuse, all together
HTTP_SCRATCH_BYTES = 64 << 10      # receive buffer for heads, one for all connections
HTTP_STREAM_BUFFER_BYTES = 1 << 20  # receive buffer of chunked bodies, one for all connections
HTTP_MAX_HEAD_BYTES = 64 << 10     # a longer response head is refused (BadResponse)
HTTP_MAX_HEADERS = 128             # and so is one with more header lines
HTTP_MAX_LENGTH_DIGITS = 15        # a longer Content-Length (a petabyte and more) is a lie: BadResponse
HTTP_MAX_INTERIM_RESPONSES = 8     # 1xx answers skipped before the real one; more is BadResponse
HTTP_IDLE_SECONDS = 15.0           # an idle keep-alive connection is dropped after this (aiohttp's default)
IDLE_SWEEP_SECONDS = 5.0           # how often a timer looks for them: none stays idle past 20 s
HTTP_MAX_IDLE_CONNECTIONS = 256    # idle keep-alive connections kept, all hosts together; the longest idle goes first
DNS_CACHE_SECONDS = 10.0           # a host's addresses kept for its next connections (aiohttp's connector keeps 10 s)

# --- Imaging: the pool and the analysis (worker/imaging/) ---------------------------------
REQUESTS_PER_PROCESS = 2           # images in hand per pool process: one analysed, one queued
IMAGE_TIMEOUT = 120.0              # seconds a pool request may wait for its answer; then its process is killed
IMAGE_PROCESS_NICENESS = 10        # pool processes yield the CPU to the event loop, which spaces requests
# Freed memory a pool process keeps for its next image, fewer page faults (docs/decisions.md, "Per-image CPU"):
IMAGE_PROCESS_KEPT_FREE_BYTES = 32 << 20
MAX_IMAGE_PIXELS = 89_478_485      # more pixels is a DecompressionBombError (Pillow's warning threshold)
THUMBNAIL_JPEG_QUALITY = 85        # the thumbnail's JPEG quality
THUMBNAIL_RESAMPLE = "BILINEAR"    # the last resize's filter (docs/decisions.md, "Thumbnails")
THUMBNAIL_REDUCING_GAP = 1.0       # how close to the target a JPEG is drafted (others box-reduced) first
MAX_EXIF_VALUE_CHARS = 4096        # a longer EXIF text value is dropped: Kafka caps a message at ~1 MB

# --- Outcomes: the task, thumbnails' storage and statistics (worker/outcomes/, imaging/thumbnails.py)
LINK_ROT_STATUSES = frozenset({404, 410})  # statuses that end a URL as link rot
INFRA_RETRY_FIRST_DELAY = 0.5      # seconds before a task first retries Kafka, Redis or S3 (jittered down by half)
INFRA_RETRY_MAX_DELAY = 10.0       # seconds between its retries at most, so it resumes soon after an outage
S3_MAX_CONNECTIONS = 32            # thumbnail uploads at once
S3_PRESIGN_SECONDS = 300           # an upload's signature is used at once; 5 minutes covers clock skew
S3_PUT_TIMEOUT = 60.0              # seconds for one thumbnail upload; a failed one is retried
S3_MAX_ANSWER_BYTES = 64 << 10     # a longer answer to a PUT (S3's are empty or a short error) is an outage
STATS_TRIM_INTERVAL = 1.0          # seconds between trims of a source's status windows (docs/decisions.md)
STATS_FORGET_SECONDS = 60.0        # a source without an outcome this long is forgotten by the worker's stats
STATS_FORGET_CHECK_SECONDS = 5.0   # ... checked this often (docs/decisions.md, "Fleet scale")

# --- The process (worker/service.py, worker/__main__.py, worker/metrics.py) ----------------
REDIS_MAX_CONNECTIONS = 32         # Redis connections per worker; a call past them waits for one
STOP_MARGIN_SECONDS = 10.0         # a stop overdue by 3 x SHUTDOWN_TIMEOUT plus this ends the worker (exit 1)
METRICS_SAMPLE_SECONDS = 1.0       # how often the scheduler's load and the body budget are read
# Histogram buckets, seconds: a site answering in 10 ms to one at READ_TIMEOUT; a body up to TOTAL_TIMEOUT.
FIRST_BYTE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DOWNLOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 90.0)
