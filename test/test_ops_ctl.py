"""The operator CLI, run as operators run it (a subprocess) against the real Redis."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common import contracts as c
from test.test_ops_http import seed

ROOT = Path(__file__).resolve().parent.parent


def ctl(redis_url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "crawl_monitor.ctl", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=30)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


async def test_status_lists_every_source_with_its_state(redis_url, redis_client) -> None:
    await seed(redis_client)
    table = ctl(redis_url, "status")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["SOURCE", "STATE", "LIMIT"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["phylopic"][1] == "halted" and rows["animaldiversity"][1] == "paused"
    # The limit (computed or overridden), the ceiling (capacity discovery's), what the adaptive
    # back-off allows now, its response times.
    assert rows["flickr"][1:10] == ["ok", "120", "-", "200", "178.38", "210/450", "120", "13250", "13188"]
    assert rows["phylopic"][5] == "off" and rows["animaldiversity"][2:7] == ["0.50", "0.50", "0.50", "0.50", "-/-"]
    assert [rows[s][10] for s in ("flickr", "animaldiversity", "phylopic")] == ["6790", "0", "9932"]  # BACKLOG
    assert lines[0].split()[11] == "BACKLOG"  # after RESP MS, two words
    assert "22 (500: 20, Timeout: 2)" in table.stdout
    as_json = json.loads(ctl(redis_url, "status", "--json").stdout)
    assert as_json["animaldiversity"]["override"] == 0.5
    assert as_json["phylopic"]["backlog"] == 9932


async def test_status_of_an_empty_crawl(redis_url) -> None:
    result = ctl(redis_url, "status")
    assert result.returncode == 0 and "no sources yet" in result.stdout


async def test_override_and_clear_override(redis_url, redis_client) -> None:
    await seed(redis_client)
    result = ctl(redis_url, "override", "Flickr", "5")
    assert result.returncode == 0, result.stderr
    assert await redis_client.get(c.override_rate_key("flickr")) == "5.0"
    assert ctl(redis_url, "override", "flickr", "0.25").returncode == 0
    assert float(await redis_client.get(c.override_rate_key("flickr"))) == 0.25
    result = ctl(redis_url, "clear-override", "flickr")
    assert result.returncode == 0 and "override removed" in result.stdout
    assert await redis_client.get(c.override_rate_key("flickr")) is None
    assert "had no override" in ctl(redis_url, "clear-override", "flickr").stdout


async def test_adaptive_off_and_on(redis_url, redis_client) -> None:
    await seed(redis_client)
    result = ctl(redis_url, "adaptive", "Flickr", "off")
    assert result.returncode == 0 and "off" in result.stdout, result.stderr
    assert await redis_client.get(c.adaptive_off_key("flickr")) is not None
    assert "back-off on" in ctl(redis_url, "adaptive", "flickr", "on").stdout
    assert await redis_client.get(c.adaptive_off_key("flickr")) is None
    assert "already on" in ctl(redis_url, "adaptive", "flickr", "on").stdout
    assert ctl(redis_url, "adaptive", "flickr", "maybe").returncode == 2
    assert "unknown source" in one_error_line(ctl(redis_url, "adaptive", "flikr", "off"))


async def test_halt_then_resume(redis_url, redis_client) -> None:
    await seed(redis_client)
    await redis_client.rpush(c.last_50_key("flickr"), *["500"] * 50)
    result = ctl(redis_url, "halt", "flickr")
    assert result.returncode == 0, result.stderr
    assert await redis_client.sismember(c.HALTED, "flickr")
    assert await redis_client.get(c.tokens_key("flickr")) == "0"
    await redis_client.sadd(c.TEMP_HALTED, "flickr")
    result = ctl(redis_url, "resume", "flickr")
    assert result.returncode == 0 and "resumed" in result.stdout
    assert not await redis_client.sismember(c.HALTED, "flickr")
    assert not await redis_client.sismember(c.TEMP_HALTED, "flickr")
    assert not await redis_client.exists(c.last_50_key("flickr"))
    assert await redis_client.sismember(c.HALTED, "phylopic")  # the others are untouched
    result = ctl(redis_url, "resume", "animaldiversity")
    assert result.returncode == 0 and not await redis_client.sismember(c.TEMP_HALTED, "animaldiversity")


@pytest.mark.parametrize("args", [
    ("override", "flickr", "0"), ("override", "flickr", "-5"), ("override", "flickr", "fast"),
    ("override", "flickr", "nan"), ("override", "flickr", "inf"), ("override", "flickr", "5/s"),
])
async def test_bad_rates_give_one_line_and_change_nothing(redis_url, redis_client, args) -> None:
    await seed(redis_client)
    line = one_error_line(ctl(redis_url, *args))
    assert "rate" in line and repr(args[2]) in line
    assert await redis_client.get(c.override_rate_key("flickr")) is None


@pytest.mark.parametrize("command", [("override", "flikr", "5"), ("clear-override", "flikr"),
                                     ("resume", "flikr"), ("halt", "flikr")])
async def test_unknown_sources_give_one_line_and_change_nothing(redis_url, redis_client, command) -> None:
    await seed(redis_client)
    line = one_error_line(ctl(redis_url, *command))
    assert "unknown source 'flikr'" in line and "known: animaldiversity, flickr, phylopic" in line
    assert not await redis_client.sismember(c.HALTED, "flikr")
    assert await redis_client.get(c.override_rate_key("flikr")) is None


def test_unreachable_redis_is_one_line_without_the_password() -> None:
    line = one_error_line(ctl("redis://:hunter2@127.0.0.1:1/0", "status"))
    assert "cannot use Redis" in line and "hunter2" not in line


def test_help_explains_every_command_with_examples() -> None:
    result = subprocess.run([sys.executable, "-m", "crawl_monitor.ctl", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0
    for text in ("status", "override", "clear-override", "resume", "halt", "examples:", "REDIS_URL"):
        assert text in result.stdout
