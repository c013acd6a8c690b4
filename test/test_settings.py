"""Settings: defaults per SPEC.md §5, and one clear line for a bad value."""
from __future__ import annotations

import subprocess
import sys

import pytest

from common.kafka import SESSION_TIMEOUT_MS, consumer_config
from common.settings import Settings, SettingsError
from devstack.stack import StackAddresses


def test_defaults_match_the_spec() -> None:
    s = Settings.from_env({})
    assert (s.redis_url, s.kafka_hosts) == ("redis://localhost:6379/0", "localhost:9092")
    assert s.s3_bucket == "cc-image-analysis"
    assert (s.target_resolution, s.max_retries, s.url_partitions, s.max_queued_urls) == (640, 1, 256, 10_000)
    assert s.s3_endpoint_url is None and s.crawl_allow_private_networks is False
    assert (s.robots_cache_bytes, s.robots_unavailable_give_up) == (64 << 20, 86400)
    assert (s.discovery_max_rate, s.discovery_sources) == (32.0, "lists")
    assert (s.robots_extra_tokens, s.content_usage_categories, s.x_robots_tag_opt_out) == (
        (), ("train-ai",), ("noai", "noimageai"))
    assert s.consent_tdmrep and s.consent_content_usage and s.consent_x_robots_tag
    assert (s.kafka_leave_group, s.kafka_session_timeout_ms) == (True, SESSION_TIMEOUT_MS)
    assert s.listen_host == "0.0.0.0"  # a fleet's scraper reaches the dashboard and /metrics


@pytest.mark.parametrize("raw, parsed", [("127.0.0.1", "127.0.0.1"), ("::1", "::1"), ("0.0.0.0", "0.0.0.0")])
def test_listen_host_is_an_address(raw: str, parsed: str) -> None:
    assert Settings.from_env({"LISTEN_HOST": raw}).listen_host == parsed


def test_the_local_stack_listens_on_this_machine_only() -> None:
    addresses = StackAddresses("redis://127.0.0.1:1/0", "127.0.0.1:2", None, "bucket")
    assert Settings.from_env(addresses.environment()).listen_host == "127.0.0.1"


@pytest.mark.parametrize("session_ms, heartbeat_ms", [(6000, 1000), (2000, 666), (1000, 333)])
def test_a_consumer_heartbeats_thrice_a_session(session_ms: int, heartbeat_ms: int) -> None:
    config = consumer_config("localhost:9092", "group", Settings.from_env(
        {"KAFKA_SESSION_TIMEOUT_MS": str(session_ms)}).kafka_session_timeout_ms)
    assert (config["session.timeout.ms"], config["heartbeat.interval.ms"]) == (session_ms, heartbeat_ms)


@pytest.mark.parametrize("raw, parsed", [("", None), ("0/2", (0, 2)), (" 3/4 ", (3, 4))])
def test_url_partition_share_is_index_of_count(raw: str, parsed: tuple[int, int] | None) -> None:
    assert Settings.from_env({"URL_PARTITION_SHARE": raw}).url_partition_share == parsed


@pytest.mark.parametrize("raw, parsed", [("lists", "lists"), ("ALL", "all"), ("none", "none")])
def test_discovery_sources_is_one_of_three(raw: str, parsed: str) -> None:
    assert Settings.from_env({"DISCOVERY_SOURCES": raw, "DISCOVERY_MAX_RATE": "40"}).discovery_sources == parsed


def test_consent_lists_are_parsed() -> None:
    s = Settings.from_env({"ROBOTS_EXTRA_TOKENS": " CCBot, img2dataset,CCBot", "CONSENT_TDMREP": "false",
                           "CONTENT_USAGE_CATEGORIES": "train-ai,Search", "X_ROBOTS_TAG_OPT_OUT": "NoAI, noindex"})
    assert s.robots_extra_tokens == ("CCBot", "img2dataset") and not s.consent_tdmrep
    assert (s.content_usage_categories, s.x_robots_tag_opt_out) == (("train-ai", "search"), ("noai", "noindex"))


@pytest.mark.parametrize("name,value", [
    ("MAX_TASKS", "many"), ("MAX_TASKS", "0"), ("TARGET_RESOLUTION", "-5"), ("MAX_RETRIES", "1.5"),
    ("KAFKA_SESSION_TIMEOUT_MS", "500"), ("LISTEN_HOST", "localhost"), ("LISTEN_HOST", "10.0.0.300"),
    ("URL_PARTITIONS", "0"), ("MAX_QUEUED_URLS", "1"), ("REDIS_URL", "localhost:6379"), ("KAFKA_HOSTS", "localhost"),
    ("S3_ENDPOINT_URL", "s3.local"), ("CRAWL_ALLOW_PRIVATE_NETWORKS", "maybe"), ("CRAWL_USER_AGENT", "x"),
    ("ROBOTS_CACHE_BYTES", "1000"), ("ROBOTS_UNAVAILABLE_GIVE_UP", "-1"),
    ("DISCOVERY_MAX_RATE", "0"), ("DISCOVERY_MAX_RATE", "fast"), ("DISCOVERY_SOURCES", "catalog"),
    ("ROBOTS_EXTRA_TOKENS", "CC Bot"), ("ROBOTS_EXTRA_TOKENS", "bot/1.0"), ("CONSENT_TDMREP", "sometimes"),
    ("CONTENT_USAGE_CATEGORIES", "train ai"), ("X_ROBOTS_TAG_OPT_OUT", "no:ai"),
    ("URL_PARTITION_SHARE", "1"), ("URL_PARTITION_SHARE", "2/2"), ("URL_PARTITION_SHARE", "-1/2"),
])
def test_bad_values_name_the_setting(name: str, value: str) -> None:
    with pytest.raises(SettingsError, match=name):
        Settings.from_env({name: value})


def test_a_replaced_setting_stops_the_process_with_what_replaced_it() -> None:
    """KAFKA_PARTITIONS sized the per-source topics, which are gone (issue 26): a deployment
    that still sets it is told in one line, not left to wonder why nothing changed."""
    with pytest.raises(SettingsError, match="KAFKA_PARTITIONS is no longer read: .*URL_PARTITIONS"):
        Settings.from_env({"KAFKA_PARTITIONS": "4"})


@pytest.mark.parametrize("pair", [{"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE"}, {"AWS_SECRET_ACCESS_KEY": "secret"}])
def test_half_an_aws_key_pair_is_refused(pair: dict[str, str]) -> None:
    """Else the S3 client and the thumbnail signer could sign as different principals."""
    with pytest.raises(SettingsError, match="AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        Settings.from_env(pair)
    both = Settings.from_env({"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "secret"})
    assert both.s3_client_kwargs()["aws_secret_access_key"] == "secret"
    assert "aws_access_key_id" not in Settings.from_env({}).s3_client_kwargs()


def test_a_process_with_a_bad_setting_exits_with_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "from common.settings import load_settings; load_settings()"],
        env={"MAX_TASKS": "lots", "PATH": ""}, capture_output=True, text=True, timeout=30,
        cwd=str(__import__("pathlib").Path(__file__).resolve().parent.parent),
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "MAX_TASKS" in result.stderr
