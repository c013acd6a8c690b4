"""What the crawler's JSON logs (one object a line, SPEC.md §4) say about a benchmark run."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path


@dataclass
class LogFacts:
    """One process's log: how often each counted event came, when each timed event came
    (Unix s), and the longest line of each sized event (bytes, without the newline)."""

    counts: dict[str, int] = field(default_factory=dict)
    times: dict[str, list[float]] = field(default_factory=dict)
    longest: dict[str, int] = field(default_factory=dict)


def read_log(path: Path, counted: set[str], timed: set[str], sized: set[str]) -> LogFacts:
    facts = LogFacts()
    with open(path, "rb") as log:
        for raw in log:
            line = raw.rstrip(b"\n")
            try:
                record = json.loads(line)
                event = record.get("event", "")
            except (ValueError, AttributeError):  # a traceback's line, say
                continue
            if event in counted:
                facts.counts[event] = facts.counts.get(event, 0) + 1
            if event in timed:
                facts.times.setdefault(event, []).append(datetime.fromisoformat(record["time"]).timestamp())
            if event in sized:
                facts.longest[event] = max(len(line), facts.longest.get(event, 0))
    return facts
