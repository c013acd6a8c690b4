"""Settings from the environment (SPEC.md §5), parsed once at start.

A bad value stops the process before it touches anything, with one line
naming the setting: an operator reading a crash-looping container's log
should see the cause in the first line, not in a traceback.
"""
from __future__ import annotations

import ipaddress
import os
import re
import sys
from dataclasses import dataclass, field
from typing import TypeVar
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

T = TypeVar("T")

DEFAULT_SOURCES_URL = "https://api.openverse.org/v1/images/stats/"
DEFAULT_USER_AGENT = (
    "cc-image-crawler/1.0 (+https://github.com/cc-archive/image-crawler; polite image analysis bot)"
)


def default_body_budget() -> int:
    """An eighth of the machine's memory for bodies downloaded and not yet analysed."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 8
    except (ValueError, OSError):  # not POSIX
        return 1 << 30


# Settings that are gone, and what replaced them: a deployment still setting one would
# otherwise run with a behaviour it did not ask for and never know.
REPLACED_SETTINGS = {
    "KAFKA_PARTITIONS": "one topic, urls, holds every source's URLs now (SPEC.md §1); "
                        "set URL_PARTITIONS (default 256) to size it, and unset KAFKA_PARTITIONS",
}


# DISCOVERY_SOURCES: sources rated by a URL list's count (or DEFAULT_SOURCE_RATE), every source
# without an override, or none.
DISCOVERY_LISTS, DISCOVERY_ALL, DISCOVERY_NONE = "lists", "all", "none"
DISCOVERY_SOURCES = (DISCOVERY_LISTS, DISCOVERY_ALL, DISCOVERY_NONE)


class SettingsError(ValueError):
    """A setting's value is unusable; the message names the setting."""


@dataclass(frozen=True)
class Settings:
    redis_url: str = "redis://localhost:6379/0"
    kafka_hosts: str = "localhost:9092"
    sources_url: str = DEFAULT_SOURCES_URL
    s3_endpoint_url: str | None = None
    s3_bucket: str = "cc-image-analysis"
    # None: thumbnails go to S3_BUCKET; a folder: they are files there (one machine: worker.imaging.thumbnails).
    thumbnail_dir: str | None = None
    aws_access_key_id: str | None = None
    aws_secret_access_key: str | None = None
    aws_default_region: str = "us-east-1"
    target_resolution: int = 640
    max_tasks: int = 500
    max_retries: int = 1
    url_partitions: int = 256
    max_queued_urls: int = 10_000
    # (index, count): this worker reads the urls partitions p with p % count == index, with no group
    # join nor rebalance (the embedded crawl's workers, url_lists.crawl.local); None: the group's share.
    url_partition_share: tuple[int, int] | None = None
    crawl_user_agent: str = DEFAULT_USER_AGENT
    crawl_allow_private_networks: bool = False
    max_image_bytes: int = 50 * 1024 * 1024
    crawl_per_host_connections: int = 8
    monitor_port: int = 8090
    listen_host: str = "0.0.0.0"  # the dashboard's and /metrics' address: every interface, for a fleet's scraper
    worker_metrics_port: int | None = None  # None: no /metrics; 0: a free port, logged
    shutdown_timeout: float = 30.0
    kafka_leave_group: bool = True
    # The least Apache Kafka accepts by default (group.min.session.timeout.ms); tansu answers a
    # JoinGroup after half of it, so the local stack sets less (docs/decisions.md).
    kafka_session_timeout_ms: int = 6000
    body_budget_bytes: int = field(default_factory=lambda: default_body_budget())
    robots_cache_bytes: int = 64 << 20
    robots_unavailable_give_up: float = 24 * 3600.0
    # Issue 27: the rate (req/s) of a source with no size anywhere; None keeps SPEC.md §3's
    # "no tokens, source_unknown".
    default_source_rate: float | None = None
    # Capacity discovery (crawl_monitor.adaptive, SPEC.md §3): the most a source that may discover
    # is granted (req/s), and which sources may: "lists" (not in SOURCES_URL), "all" or "none".
    discovery_max_rate: float = 32.0
    discovery_sources: str = "lists"
    # Consent (README "Consent"): product tokens whose robots.txt groups bind us too,
    # and a switch per further signal, each on by default.
    robots_extra_tokens: tuple[str, ...] = ()
    consent_tdmrep: bool = True
    consent_content_usage: bool = True
    content_usage_categories: tuple[str, ...] = ("train-ai",)
    consent_x_robots_tag: bool = True
    x_robots_tag_opt_out: tuple[str, ...] = ("noai", "noimageai")

    def __post_init__(self) -> None:
        # Half a key pair is a mistake, not a request for some other identity: botocore's
        # own environment lookup refuses it too, and the client and the thumbnail signer
        # must sign as the same principal.
        if bool(self.aws_access_key_id) != bool(self.aws_secret_access_key):
            raise SettingsError("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set together "
                                "(or neither, for the default chain: profile, instance role)")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env

        def get(name: str, parse: Callable[[str], T], default: T) -> T:
            raw = env.get(name, "")
            if raw.strip() == "":
                return default
            try:
                return parse(raw.strip())
            except (ValueError, TypeError) as exc:
                raise SettingsError(f"{name}={raw!r} is invalid: {exc}") from None

        for name, successor in REPLACED_SETTINGS.items():
            if env.get(name, "").strip():
                raise SettingsError(f"{name} is no longer read: {successor}")
        d = cls()
        return cls(
            redis_url=get("REDIS_URL", _url("redis", "rediss", "unix"), d.redis_url),
            kafka_hosts=get("KAFKA_HOSTS", _hosts, d.kafka_hosts),
            sources_url=get("SOURCES_URL", str, d.sources_url),
            s3_endpoint_url=get("S3_ENDPOINT_URL", _url("http", "https"), None),
            s3_bucket=get("S3_BUCKET", _nonempty, d.s3_bucket),
            thumbnail_dir=get("THUMBNAIL_DIR", str, None),
            aws_access_key_id=get("AWS_ACCESS_KEY_ID", str, None),
            aws_secret_access_key=get("AWS_SECRET_ACCESS_KEY", str, None),
            aws_default_region=get("AWS_DEFAULT_REGION", str, d.aws_default_region),
            target_resolution=get("TARGET_RESOLUTION", _in(int, 16, 10_000), d.target_resolution),
            max_tasks=get("MAX_TASKS", _in(int, 1, 100_000), d.max_tasks),
            max_retries=get("MAX_RETRIES", _in(int, 0, 100), d.max_retries),
            url_partitions=get("URL_PARTITIONS", _in(int, 1, 10_000), d.url_partitions),
            max_queued_urls=get("MAX_QUEUED_URLS", _in(int, 10, 10_000_000), d.max_queued_urls),
            url_partition_share=get("URL_PARTITION_SHARE", _share, None),
            crawl_user_agent=get("CRAWL_USER_AGENT", _user_agent, d.crawl_user_agent),
            crawl_allow_private_networks=get("CRAWL_ALLOW_PRIVATE_NETWORKS", _bool, False),
            max_image_bytes=get("MAX_IMAGE_BYTES", _in(int, 1024, 2**40), d.max_image_bytes),
            crawl_per_host_connections=get(
                "CRAWL_PER_HOST_CONNECTIONS", _in(int, 1, 1000), d.crawl_per_host_connections),
            monitor_port=get("MONITOR_PORT", _in(int, 0, 65535), d.monitor_port),
            listen_host=get("LISTEN_HOST", _address, d.listen_host),
            worker_metrics_port=get("WORKER_METRICS_PORT", _in(int, 0, 65535), d.worker_metrics_port),
            shutdown_timeout=get("SHUTDOWN_TIMEOUT", _in(float, 0, 3600), d.shutdown_timeout),
            kafka_leave_group=get("KAFKA_LEAVE_GROUP", _bool, d.kafka_leave_group),
            kafka_session_timeout_ms=get("KAFKA_SESSION_TIMEOUT_MS", _in(int, 1000, 300_000),
                                         d.kafka_session_timeout_ms),
            body_budget_bytes=get("BODY_BUDGET_BYTES", _in(int, 1 << 20, 2**48), d.body_budget_bytes),
            robots_cache_bytes=get("ROBOTS_CACHE_BYTES", _in(int, 1 << 20, 2**40), d.robots_cache_bytes),
            robots_unavailable_give_up=get("ROBOTS_UNAVAILABLE_GIVE_UP", _in(float, 0, 365 * 86400),
                                           d.robots_unavailable_give_up),
            default_source_rate=get("DEFAULT_SOURCE_RATE", _in(float, 0.001, 200.0), None),
            discovery_max_rate=get("DISCOVERY_MAX_RATE", _in(float, 1.0, 1000.0), d.discovery_max_rate),
            discovery_sources=get("DISCOVERY_SOURCES", _one_of(*DISCOVERY_SOURCES), d.discovery_sources),
            robots_extra_tokens=get("ROBOTS_EXTRA_TOKENS", _names(r"[A-Za-z0-9_.-]+", lower=False), ()),
            consent_tdmrep=get("CONSENT_TDMREP", _bool, True),
            consent_content_usage=get("CONSENT_CONTENT_USAGE", _bool, True),
            content_usage_categories=get("CONTENT_USAGE_CATEGORIES", _names(r"[a-z0-9_.*-]+"),
                                         d.content_usage_categories),
            consent_x_robots_tag=get("CONSENT_X_ROBOTS_TAG", _bool, True),
            x_robots_tag_opt_out=get("X_ROBOTS_TAG_OPT_OUT", _names(r"[a-z0-9_-]+"), d.x_robots_tag_opt_out),
        )

    def s3_client_kwargs(self) -> dict[str, str]:
        """Keyword arguments for ``aiobotocore`` ``create_client('s3', ...)``."""
        kwargs = {"region_name": self.aws_default_region}
        if self.s3_endpoint_url:
            kwargs["endpoint_url"] = self.s3_endpoint_url
        if self.aws_access_key_id and self.aws_secret_access_key:  # else the default chain
            kwargs["aws_access_key_id"] = self.aws_access_key_id
            kwargs["aws_secret_access_key"] = self.aws_secret_access_key
        return kwargs


def _share(raw: str) -> tuple[int, int]:
    """``index/count``, 0 <= index < count <= 10,000."""
    index, slash, count = raw.partition("/")
    if not slash:
        raise ValueError("expected index/count, such as 0/2")
    share = int(index), int(count)
    if not 0 <= share[0] < share[1] <= 10_000:
        raise ValueError("expected 0 <= index < count <= 10000")
    return share


def _nonempty(raw: str) -> str:
    if not raw:
        raise ValueError("must not be empty")
    return raw


N = TypeVar("N", int, float)


def _in(kind: Callable[[str], N], low: N, high: N) -> Callable[[str], N]:
    """A parser of ``kind`` (int or float) that refuses values outside [low, high]."""
    def parse(raw: str) -> N:
        value = kind(raw)
        if not low <= value <= high:
            raise ValueError(f"must be between {low} and {high}")
        return value
    return parse


def _one_of(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw.lower() not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return raw.lower()
    return parse


def _names(pattern: str, lower: bool = True) -> Callable[[str], tuple[str, ...]]:
    """A comma-separated list of names, each matching ``pattern`` (lower-cased first if ``lower``)."""
    def parse(raw: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(n.strip().lower() if lower else n.strip() for n in raw.split(",") if n.strip()))
        bad = [n for n in names if not re.fullmatch(pattern, n)]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a name of {pattern}")
        return names
    return parse


def _address(raw: str) -> str:
    """An IP address to listen on (``0.0.0.0``: every interface; ``127.0.0.1``: this machine only)."""
    return str(ipaddress.ip_address(raw))


def _bool(raw: str) -> bool:
    lowered = raw.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be true or false")


def _url(*schemes: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        parts = urlsplit(raw)
        if parts.scheme not in schemes or (parts.scheme != "unix" and not parts.hostname):
            raise ValueError(f"must be a {'/'.join(schemes)} URL")
        return raw
    return parse


def _hosts(raw: str) -> str:
    for host in raw.split(","):
        name, _, port = host.strip().rpartition(":")
        if not name or not port.isdigit():
            raise ValueError("must be a comma-separated list of host:port")
    return raw


def _user_agent(raw: str) -> str:
    if not raw.isprintable() or "/" not in raw.split()[0]:
        raise ValueError("must start with a product token such as name/1.0")
    return raw


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Settings for a process entry point: exit with one line on a bad value."""
    try:
        return Settings.from_env(env)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

