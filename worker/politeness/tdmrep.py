"""The W3C TDM Reservation Protocol's file on the origin (TDMRep final CG report, 2024, section 3.1):
``/.well-known/tdmrep.json``, fetched once per origin per day for the whole cluster exactly as
robots.txt is (``worker.politeness.robots``: Redis ``tdmrep:{origin}``, a lock, the same backoff),
and matched before any request to a path.

The file is a JSON array of rules ``{"location", "tdm-reservation", "tdm-policy"}``; the first rule
whose location (a robots.txt-style pattern, ``worker.politeness.path_pattern``) matches a URL's
path decides; ``tdm-reservation: 1`` reserves it, so it is never requested. What a site's answer
means (docs/decisions.md "Consent"):

- 2xx with a JSON array: its valid rules (a rule with no string location or a reservation other
  than 0 or 1 is a protocol error and is skipped, as the report says);
- 2xx that is not JSON, not an array, or nested past the parser (a soft 404's HTML page): the
  origin does not implement the protocol, nothing is reserved;
- an array longer than MAX_FILE_BYTES, or whose rules are longer than MAX_RULES_BYTES stored:
  everything is reserved (cutting it could drop the rule that reserves a path);
- 4xx, or more than 5 redirects: no file, nothing reserved;
- 5xx, 429, a timeout, no connection: unavailable, the origin's URLs wait (never end) as for
  robots.txt, up to ROBOTS_UNAVAILABLE_GIVE_UP;
- a redirect to an address we must not reach: everything reserved (no answer will come).
"""
from __future__ import annotations

import json
from typing import Any

from common.contracts import EVENT_TDMREP_FETCHED, SIGNAL_TDMREP_FILE, tdmrep_key, tdmrep_lock_key
from common.statuses import Status
from worker.fetching.http_client import HttpClient
from worker.politeness.addresses import AddressGuard
from worker.politeness.consent import Decision
from worker.politeness.path_pattern import MAX_PATTERN_CHARS, FirstMatch, url_path
from worker.politeness.robots import (ALLOW_ALL, DISALLOW_ALL, RULES, RULES_BASE_BYTES, RobotsCache, RobotsFile,
                                      Rules, fetch_origin_file)

TDMREP_PATH = "/.well-known/tdmrep.json"
MAX_FILE_BYTES = 512 * 1024   # read no more; a real file is a few rules
MAX_RULES_BYTES = 64 * 1024   # the rules kept in Redis and parsed by every worker, as robots.txt's group
# Parsed rules' memory: this much a rule (its compiled pattern) and a character kept (docs/decisions.md, "Consent").
TDM_BYTES_PER_RULE = 1200
TDM_BYTES_PER_CHAR = 4


def condensed_rules(text: str) -> str | None:
    """The file's valid rules as the JSON kept in Redis (``[[location, reservation, policy]]``),
    "" when it is no TDMRep file at all, None when they are too long to keep."""
    try:
        data: Any = json.loads(text)
    except (ValueError, RecursionError):
        return ""
    if not isinstance(data, list):
        return ""
    rules = []
    for rule in data:
        if not isinstance(rule, dict):
            continue
        location, reservation = rule.get("location"), rule.get("tdm-reservation")
        if not isinstance(location, str) or not location or len(location) > MAX_PATTERN_CHARS:
            continue
        if isinstance(reservation, bool) or reservation not in (0, 1):
            continue
        policy = rule.get("tdm-policy")
        rules.append([location, int(reservation), policy[:500] if isinstance(policy, str) else None])
    kept = json.dumps(rules, separators=(",", ":"))
    return None if len(kept.encode()) > MAX_RULES_BYTES else kept


async def fetch_tdmrep(client: HttpClient, origin: str, guard: AddressGuard) -> RobotsFile:
    """Fetch origin's tdmrep.json, every redirect hop checked by the address guard; the body of a
    RULES answer is the condensed rules (``condensed_rules``)."""
    return await fetch_origin_file(client, f"{origin}{TDMREP_PATH}", guard, MAX_FILE_BYTES + 1, _answer)


def _answer(data: bytes, status: int) -> RobotsFile:
    text = data.decode("utf-8-sig", errors="replace")
    if len(data) > MAX_FILE_BYTES:
        # A TDMRep file this long is hostile or broken: reserved everywhere. Anything else this
        # long (an HTML page for a missing file) is no TDMRep file.
        return RobotsFile(DISALLOW_ALL if text.lstrip().startswith("[") else ALLOW_ALL, status=status)
    rules = condensed_rules(text)
    if rules is None:
        return RobotsFile(DISALLOW_ALL, status=status)
    if not rules or rules == "[]":
        return RobotsFile(ALLOW_ALL, status=status)
    return RobotsFile(RULES, rules, status)


class TdmRules(Rules):
    """A tdmrep.json record, matched: the first rule whose location matches decides."""

    def __init__(self, file: RobotsFile):  # noqa: D107 - Rules' reading does not apply
        self.verdict = file.verdict
        self.retry_at = file.retry_at
        self.status = file.status
        self._rules: list[list[Any]] = json.loads(file.body) if file.verdict == RULES else []
        self._match = FirstMatch([rule[0] for rule in self._rules])
        self.size = RULES_BASE_BYTES + TDM_BYTES_PER_RULE * len(self._rules) + TDM_BYTES_PER_CHAR * len(file.body)

    def refusal(self, url: str) -> Decision | None:
        if self.verdict != RULES:
            if self.verdict == ALLOW_ALL:
                return None
            return Decision(SIGNAL_TDMREP_FILE, f"{self.verdict} (tdmrep.json status {self.status})")
        index = self._match.first(url_path(url))
        if index is None:
            return None
        location, reservation, policy = self._rules[index]
        if reservation != 1:
            return None
        return Decision(SIGNAL_TDMREP_FILE, f"{location} reserved" + (f" (policy {policy})" if policy else ""))

    @property
    def crawl_delay(self) -> float:
        return 0.0


class TdmRepCache(RobotsCache):
    """tdmrep.json per origin, shared and cached as robots.txt is."""

    key = staticmethod(tdmrep_key)
    lock_key = staticmethod(tdmrep_lock_key)
    event = EVENT_TDMREP_FETCHED
    unavailable_status = Status.TDMREP_UNAVAILABLE
    refused_status = Status.OPTED_OUT

    def _compile(self, file: RobotsFile) -> Rules:
        return TdmRules(file)

    def _tokens(self) -> list[str]:
        return []

    def _condense(self, file: RobotsFile) -> RobotsFile:
        return file  # fetch_tdmrep condensed it
