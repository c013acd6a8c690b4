"""The worker's tuning knobs, in one place so their trade-offs can be read together.

Settings an operator changes per deployment live in ``common.settings``;
these are the engineering defaults behind them.
"""
from __future__ import annotations

# --- HTTP (worker/fetching/fetch.py) -------------------------------------------------
CONNECT_TIMEOUT = 10.0        # seconds to open a connection
READ_TIMEOUT = 30.0           # seconds of silence on an open connection
TOTAL_TIMEOUT = 90.0          # seconds for one hop, headers and body
MAX_REDIRECTS = 5
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})

# --- Outcomes (worker/outcomes/task.py) ----------------------------------------------
LINK_ROT_STATUSES = frozenset({404, 410})
# Backoff for our own infrastructure (Kafka, Redis, S3): their failures are
# never a URL's outcome, so the task waits them out instead.
# A task retries at most this far apart: with 30 s, the crawl went on 28 s after S3 was back
# (test_s3_outage_mid_crawl_thumbnails_wait). Each wait is jittered down by up to half, so
# the tasks of a fleet that failed together do not all come back in the same instant.
INFRA_RETRY_FIRST_DELAY = 0.5
INFRA_RETRY_MAX_DELAY = 10.0
S3_MAX_CONNECTIONS = 32
S3_PRESIGN_SECONDS = 300      # an upload's signature is used at once; 5 minutes covers clock skew
S3_PUT_TIMEOUT = 60.0         # seconds for one thumbnail upload; a failed one is retried
S3_MAX_ANSWER_BYTES = 64 << 10  # a longer answer to a PUT (S3's are empty or a short error) is an outage

# --- Images (worker/imaging/analysis.py) ----------------------------------------------
# Pillow raises DecompressionBombError above this many pixels (its own
# default warning threshold, ~89 MP, made an error): a 100 MP RGB image is
# 300 MB in memory per pool process.
MAX_IMAGE_PIXELS = 89_478_485
THUMBNAIL_JPEG_QUALITY = 85
# Cheap shrinking: the image work is most of a worker's CPU, and the q85 encoding hides the
# difference (docs/decisions.md, "Thumbnails"). The gap: how close to the target a JPEG is
# decoded at a DCT scale (other formats box-reduced) before the bilinear pass.
THUMBNAIL_RESAMPLE = "BILINEAR"
THUMBNAIL_REDUCING_GAP = 1.0
MAX_EXIF_VALUE_CHARS = 4096   # a longer text value is dropped: Kafka caps a message at ~1 MB

# --- Handing bytes to the pool (worker/imaging/pool.py) ----------------------------------
# Each pool process has one image in hand and one queued, so it never waits
# for the event loop between images.
REQUESTS_PER_PROCESS = 2
# Seconds a pool request may wait for its answer (the image queued ahead of it included); past
# it the process is killed and the image ends as ImageTimeout. Decoding a 12 MP photo takes
# well under a second: this bounds a decoder that never returns, not a busy machine.
IMAGE_TIMEOUT = 120.0
# Pool processes run at this nice value: on a busy machine the image work yields
# the CPU to the event loop, whose timing is what keeps requests evenly spaced.
IMAGE_PROCESS_NICENESS = 10
# A pool process's C allocator keeps this much freed memory for the next image instead of
# giving it back to the kernel, which handed it out again as fresh pages: ~90-160 page
# faults an image (docs/decisions.md, "Freed memory kept in the pool processes"). Above
# Pillow's 16 MB blocks, so that an image's blocks are reused too.
IMAGE_PROCESS_KEPT_FREE_BYTES = 32 << 20

# --- Downloads (worker/fetching/http_client.py, worker/fetching/shared_memory.py) ----------------------
# A body is received straight into a shared-memory segment, backed a step at a time as
# bytes arrive. Idle segments are kept for reuse (a fresh one pays a page fault per page)
# up to this much backed memory in all.
SEGMENT_STEP = 1 << 20
IDLE_SEGMENT_BYTES = 128 << 20
HTTP_SCRATCH_BYTES = 64 << 10      # receive buffer for heads, one per connection
HTTP_STREAM_BUFFER_BYTES = 1 << 20 # receive buffer of chunked bodies, one for all connections
HTTP_MAX_HEAD_BYTES = 64 << 10     # a longer response head is refused (BadResponse)
HTTP_MAX_HEADERS = 128             # and so is one with more header lines
HTTP_MAX_LENGTH_DIGITS = 15        # a longer Content-Length (a petabyte and more) is a lie: BadResponse
HTTP_MAX_INTERIM_RESPONSES = 8     # 1xx answers skipped before the real one; more is BadResponse
HTTP_IDLE_SECONDS = 15.0           # an idle keep-alive connection is dropped after this (aiohttp's default)
IDLE_SWEEP_SECONDS = 5.0           # how often a timer looks for them: none stays idle past 20 s
HTTP_MAX_IDLE_CONNECTIONS = 256    # idle keep-alive connections kept, all hosts together

# --- Statistics (worker/outcomes/stats.py) ---------------------------------------------
# Seconds between trims of a source's status windows (status60s/1hr/12hr): trimming on
# every outcome was a third of its Redis commands (docs/decisions.md).
STATS_TRIM_INTERVAL = 1.0
# A source without an outcome this long is forgotten by the worker's stats (its trim and expiry
# times): the memory follows the sources being crawled, not every source of the day.
STATS_FORGET_SECONDS = 60.0

# --- Token buckets (worker/fetching/tokens.py) -----------------------------------------
# A source's tasks wait for its tokens in turns: one at a time per turn, one turn for every
# TOKEN_TURN_RATE req/s of its rate. A turn takes a few rounds of the event loop per token (the
# script's answer, the hand-over to the next task), so one turn of a busy worker served 25-45
# tokens a second: a 100 req/s source got 30-53% of its limit beside 5,000 slow ones (bench.sources).
TOKEN_TURN_RATE = 20.0
# An empty bucket is polled by one task per turn; the interval follows the
# source's rate (a token every 1/rate s) within these bounds.
TOKEN_POLL_MIN = 0.05
TOKEN_POLL_MAX = 0.25
# The waiting sources' peeks share one MGET, at most one every this many seconds (a worker's
# token reads per second do not grow with its sources).
TOKEN_PEEK_INTERVAL = 0.01
# A source whose task waits for tokens is scored in waiting_sources this often: the monitor
# grants tokens only to sources active in its last ACTIVE_SOURCES_TICK_SECONDS (8 s), so this
# short a beat keeps a waiting source in while a finished one drops out soon (docs/decisions.md).
ACTIVE_HEARTBEAT_SECONDS = 2.0
# A source no task asked tokens for in this long is forgotten by the worker's TokenBuckets.
TOKENS_FORGET_SECONDS = 120.0
# Requests to a source are spaced 1 / rate apart cluster-wide; one may go up to
# PACE_CATCH_UP_SECONDS ahead of its even slot (a worker that was late catches up), and only
# if the source's previous floor(rate) + 1 requests were sent at least SEND_WINDOW_SECONDS
# earlier: no second at the site holds more than floor(rate) + 1, while requests delayed
# unequally on their way by up to SEND_WINDOW_SECONDS - 1 s still arrive apart. The log keeps
# at most SEND_LOG_MAX sends (rates above that are held over a proportionally shorter window).
# Numbers in docs/decisions.md, "Pacing".
PACE_CATCH_UP_SECONDS = 0.05
SEND_WINDOW_SECONDS = 1.05
SEND_LOG_MAX = 1000
# A token whose answer arrived later than the fastest answers (a low quantile: down at once, up
# by TOKEN_ANSWER_SMOOTHING of the difference per slower answer) by more than the spread the
# source's rate tolerates is not used (worker/fetching/tokens.py, tolerated_lateness): the worker was
# stalled, and its request would reach the site bunched with the next ones. The spread is
# what floor(rate) + 2 sends span beyond one second, less ARRIVAL_JITTER_SECONDS for the way
# to the site; at least STALE_TOKEN_SECONDS (SEND_WINDOW_SECONDS - 1 - ARRIVAL_JITTER_SECONDS).
ARRIVAL_JITTER_SECONDS = 0.02
STALE_TOKEN_SECONDS = 0.03
TOKEN_ANSWER_SMOOTHING = 0.01
FORFEIT_REPORT_SECONDS = 60.0  # at most one worker_tokens_forfeited line a minute

# --- URLs waiting in Kafka (worker/parking/) ------------------------------------
# The length of a turn in each wait topic (common.contracts.WAIT_TOPICS): a wait
# takes the longest turn it covers, so an hour's wait is one message, not 120.
WAIT_TIER_SECONDS = (30.0, 300.0, 3600.0)
WAIT_POLL_SECONDS = 0.5  # how late past its time a waiting URL may be handed back
# Records of one wait partition the line holds at most (any of them is handed over when due);
# with 96 wait partitions over two workers, ~24,000 records, ~10 MB, at worst.
WAIT_HELD_PER_PARTITION = 500
# A parked URL of a source whose rate is unknown or zero (paused by Retry-After, temporarily
# halted) is tried again this much later.
PARK_DEFAULT_SECONDS = 30.0
# A parked URL of a source whose adaptive state the scheduler has not read yet (new: the monitor
# saves it within a second or two of its first grant) comes back this much later, when its pace is known.
PARK_UNJUDGED_SECONDS = 5.0
# How far ahead a source held below its pace here (what it achieved, not its grant) has its URLs
# placed: what it achieved in the last seconds says little about minutes ahead. Further URLs come
# back after this and are placed again by what it achieves then (one turn of the shortest line).
PARK_TRUST_SECONDS = WAIT_TIER_SECONDS[0]
# The halted line reads urls_halted when a source leaves the halted sets, and at least this
# often besides (a resume it missed, a URL parked just as its source was resumed).
HALTED_RESCAN_SECONDS = 600.0
# After a resume it has seen, the line scans again every HALTED_RESUME_RESCAN_SECONDS for
# HALTED_RESUME_GRACE_SECONDS: the other workers see the resume up to REFRESH_INTERVAL later
# (longer if Redis is slow to answer) and park its URLs until then. Each of these scans writes
# the still-halted sources' URLs once more.
HALTED_RESUME_GRACE_SECONDS = 20.0
HALTED_RESUME_RESCAN_SECONDS = 5.0

# --- Redis (worker/__main__.py) ------------------------------------------------
# Connections per worker; a task past them waits for one (common.redis_client). Every call
# is one short round trip, so a few dozen serve MAX_TASKS; a fleet of 100 workers then holds
# a few thousand of Redis's 10,000 (maxclients).
REDIS_MAX_CONNECTIONS = 32

# A stop overdue after 3 x SHUTDOWN_TIMEOUT and this many seconds more ends the worker (exit 1,
# every thread's stack on stderr): the consumers' close and the pool's are not bounded otherwise.
STOP_MARGIN_SECONDS = 10.0

# --- Scheduling (worker/scheduling/scheduler.py) -----------------------------------------
POLL_BATCH = 500              # messages per consumer poll
POLL_TIMEOUT = 0.1            # seconds a poll may wait for messages
REFRESH_INTERVAL = 2.0        # seconds between reads of halts and rates
NEW_SOURCE_REFRESH = 0.2      # seconds: how soon a source new to this worker has its rate read
# Per-source state (rates, latencies, token turns) of sources with no work here is dropped once
# it holds this many more than twice the sources with work: bounded, and not rebuilt every refresh.
FORGET_ABOVE = 2000
COMMIT_INTERVAL = 1.0         # seconds between offset commits
OFFER_INTERVAL = 0.1          # seconds between positions offered for a revocation's commit
# Finished offsets above a partition's commit, kept in Redis for its next owner (worker.intake.finished_offsets):
# written every FINISHED_FLUSH_INTERVAL seconds (what finished since is done again after a crash),
# kept FINISHED_OFFSETS_TTL seconds after the last write, at most FINISHED_OFFSETS_BUFFER held while
# Redis does not answer.
FINISHED_FLUSH_INTERVAL = 0.2
FINISHED_OFFSETS_TTL = 7 * 24 * 3600
FINISHED_OFFSETS_BUFFER = 100_000
MIN_TASKS_PER_SOURCE = 1      # the floor that keeps a slow source from starving
CONCURRENCY_HEADROOM = 2.0    # slots per source = rate x latency x headroom
# A source's queue here holds this many seconds of its rate (or twice its slots, if more);
# its next URLs are parked in Kafka until their turn (worker.scheduling.scheduler), so that no source holds
# back the others of its partition.
QUEUE_SECONDS = 5.0
# While the worker is short of CPU, fast sources first (worker.scheduling.slow_starts): a source paced at
# FAST_SOURCE_RATE or more needs a token every 200 ms or less, which a loop running tens of ms late
# takes from it; a slower one does not notice. While a fast source works here, the slow sources'
# starts a second fall by SLOW_STARTS_DECREASE each ADMISSION_UPDATE_SECONDS the loop's mean delay
# (a timer every LOOP_LAG_PROBE_SECONDS) is over LOOP_LAG_TARGET, and climb by SLOW_STARTS_INCREASE
# (+1) each one it is under; never under what the slow sources here ask (their summed paces) or
# SLOW_SHARE of the tasks the worker ends a second, whichever is less, nor under SLOW_STARTS_FLOOR.
# Numbers in docs/decisions.md, issue 26.
FAST_SOURCE_RATE = 5.0
LOOP_LAG_PROBE_SECONDS = 0.02
LOOP_LAG_TARGET = 0.01
ADMISSION_UPDATE_SECONDS = 1.0
SLOW_STARTS_DECREASE = 0.7
SLOW_STARTS_INCREASE = 1.1
SLOW_STARTS_FLOOR = 2.0
SLOW_SHARE = 0.25
SLOW_STARTS_BURST_SECONDS = 0.25  # the allowance saved up at most
ADMISSION_REPORT_SECONDS = 10.0   # a worker_slow_sources_held line at most this often while limited
THROUGHPUT_SMOOTHING = 0.5   # weight of a refresh's measure in a source's throughput here
THROUGHPUT_WARMUP_SECONDS = 5.0  # a source's first seconds of work here are not measured
# Past this share of MAX_QUEUED_URLS held, the partitions that feed no fast source are paused (all
# of them at the bound), until half has gone.
SLOW_PARTITIONS_PAUSE_AT = 0.75
QUEUE_UNRATED = 1000          # URLs of a source queued before its rate is known here (then trimmed)
QUEUE_MAX_PER_SOURCE = 5000   # URLs; an operator's override of thousands a second queues no more
DEFAULT_LATENCY = 1.0         # seconds a task is assumed to take before any is observed
LATENCY_SMOOTHING = 0.2       # weight of a new sample in the latency average
ASSIGN_OFFSETS_TIMEOUT = 30.0  # seconds for the committed offsets of newly assigned partitions (worker/intake/feed.py)
CONSUMER_EXTRA_CONFIG = {
    # Round-robin, eager: the subscription never changes during a crawl (one urls topic, issue
    # 26), so a rebalance comes only with a worker joining or leaving the group. (librdkafka's
    # cooperative-sticky assignor never finished assigning the 20,000 partitions of the
    # per-source layout, issue 20.)
    "partition.assignment.strategy": "roundrobin",
    "queued.max.messages.kbytes": 8192,
}

# --- The worker's /metrics (worker/metrics.py) -----------------------------------
METRICS_SAMPLE_SECONDS = 1.0  # how often the scheduler's load and the body budget are read
# Histogram buckets, seconds: a site answering in 10 ms to one at READ_TIMEOUT; a body in one
# packet to a large photo on a slow link, up to TOTAL_TIMEOUT.
FIRST_BYTE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DOWNLOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 90.0)
