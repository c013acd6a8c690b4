"""Prometheus's own linter, ``promtool`` (Debian's ``prometheus`` package; ``make test`` installs it).

A missing promtool fails the test that needs it, loudly: nothing is skipped.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def _run(*args: str, stdin: bytes | None = None) -> str:
    assert Path(PROMTOOL).is_file(), "promtool is missing: apt-get install prometheus (make test does)"
    done = subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, timeout=60)
    output = (done.stdout + done.stderr).decode(errors="replace").strip()
    assert done.returncode == 0, f"promtool {' '.join(args)} exited {done.returncode}:\n{output}"
    return output


def check_metrics(exposition: bytes | str) -> None:
    """``promtool check metrics``: fails on any warning (it exits 3 and names each problem)."""
    data = exposition.encode() if isinstance(exposition, str) else exposition
    output = _run("check", "metrics", stdin=data)
    assert output == "", f"promtool check metrics:\n{output}"


def check_config(path: Path) -> str:
    """``promtool check config`` on a Prometheus configuration file."""
    return _run("check", "config", "--syntax-only", str(path))


def check_rules(path: Path) -> str:
    """``promtool check rules``: parses every expression of a rules file."""
    return _run("check", "rules", str(path))
