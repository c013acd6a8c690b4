"""What a dataset's rows came to: counts per shard and for the whole crawl, and the summary a person reads.

A ``Tally`` counts finished rows by outcome, error reason, HTTP status and site; a shard's is
written in its ``{shard}_stats.json`` (beside img2dataset's own fields), and the crawl's is the
merge of every shard's. Pure arithmetic: no I/O here.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from url_lists.results import ERROR, LINK_ROT, OPTED_OUT, SUCCESS

TOP_SITES = 20
# The crawl's per-site failure counts keep this many sites; past it, the least failing half is
# dropped (the top 20 stay exact unless a site's failures are spread thinner than that).
MAX_SITES = 10_000
BAD_ROW = "bad row"  # img2dataset's status_dict counts reasons; a bad row's own one is in its parquet row
MAX_BAD_ROWS_LISTED = 1_000  # in stats.json; every bad row is in its shard's parquet and stats


def _prune(counter: Counter[str], limit: int) -> None:
    if len(counter) > limit:
        kept = counter.most_common(limit // 2)
        counter.clear()
        counter.update(dict(kept))


@dataclass
class Tally:
    rows: int = 0
    successes: int = 0
    link_rot: int = 0
    errors: int = 0
    bad_rows: int = 0
    by_reason: Counter[str] = field(default_factory=Counter)
    by_http_status: Counter[str] = field(default_factory=Counter)
    failures_by_site: Counter[str] = field(default_factory=Counter)
    opted_out: Counter[str] = field(default_factory=Counter)  # by the signal that decided (SPEC.md §1)
    other_outcomes: Counter[str] = field(default_factory=Counter)  # an outcome this code does not know
    waited_for_robots: int = 0
    waited_for_retry_after: int = 0
    bad: list[dict[str, Any]] = field(default_factory=list)  # {"file", "row", "reason"}
    max_bad_listed: int | None = None  # None: all

    def add(self, outcome: dict[str, Any], site: str | None = None) -> None:
        """One finished row; ``outcome`` as ``outcomes.py`` makes it."""
        self.rows += 1
        status = outcome.get("status")
        if status == SUCCESS:
            self.successes += 1
        elif status == LINK_ROT:
            self.link_rot += 1
        elif status == ERROR:
            self.errors += 1
            if not outcome.get("bad"):  # a bad row's reason names its value: listed with its row instead
                self.by_reason[str(outcome.get("error_message"))] += 1
                _prune(self.by_reason, MAX_SITES)
            http = outcome.get("http_status")
            if http is not None:
                self.by_http_status[str(http)] += 1
            if outcome.get("bad"):
                self.bad_rows += 1
                if self.max_bad_listed is None or len(self.bad) < self.max_bad_listed:
                    self.bad.append({"file": outcome.get("source_file"), "row": outcome.get("source_row"),
                                     "reason": outcome.get("error_message")})
        elif status == OPTED_OUT:
            self.opted_out[str(outcome.get("error_message")).partition(":")[0]] += 1
        else:
            self.other_outcomes[str(status)] += 1
        if status not in (SUCCESS, OPTED_OUT) and site and not outcome.get("bad"):  # an opt-out is no failure
            self.failures_by_site[site] += 1
            _prune(self.failures_by_site, MAX_SITES)
        if outcome.get("robots_wait"):
            self.waited_for_robots += 1
        if outcome.get("retry_after_wait"):
            self.waited_for_retry_after += 1

    def merge(self, other: dict[str, Any]) -> None:
        """Add a shard's ``as_dict()`` (read back from its stats file)."""
        for name in ("rows", "successes", LINK_ROT, "errors", "bad_rows", "waited_for_robots",
                     "waited_for_retry_after"):
            setattr(self, name, getattr(self, name) + int(other.get(name, 0)))
        for name in ("by_reason", "by_http_status", "failures_by_site", OPTED_OUT, "other_outcomes"):
            getattr(self, name).update({str(k): int(v) for k, v in (other.get(name) or {}).items()})
        _prune(self.failures_by_site, MAX_SITES)
        for bad in other.get("bad") or []:
            if self.max_bad_listed is not None and len(self.bad) >= self.max_bad_listed:
                break
            self.bad.append(bad)

    def as_dict(self, top_sites: int | None = None) -> dict[str, Any]:
        sites = self.failures_by_site.most_common(top_sites)
        return {
            "rows": self.rows, "successes": self.successes, LINK_ROT: self.link_rot, "errors": self.errors,
            "bad_rows": self.bad_rows,
            "by_reason": dict(self.by_reason.most_common()),
            "by_http_status": dict(sorted(self.by_http_status.items())),
            "failures_by_site": dict(sites),
            OPTED_OUT: dict(self.opted_out.most_common()),
            "other_outcomes": dict(self.other_outcomes),
            "waited_for_robots": self.waited_for_robots,
            "waited_for_retry_after": self.waited_for_retry_after,
            "bad": list(self.bad),
        }


def shard_stats(tally: Tally, start: float, end: float) -> dict[str, Any]:
    """A shard's ``{shard}_stats.json``: img2dataset's fields first (its readers sum them), then ours."""
    return {
        "count": tally.rows, "successes": tally.successes,
        "failed_to_download": tally.rows - tally.successes, "failed_to_resize": 0,
        "duration": end - start, "start_time": start, "end_time": end,
        "status_dict": {SUCCESS: tally.successes, **dict(tally.by_reason), **(
            {LINK_ROT: tally.link_rot} if tally.link_rot else {}), **(
            {OPTED_OUT: sum(tally.opted_out.values())} if tally.opted_out else {}), **(
            {BAD_ROW: tally.bad_rows} if tally.bad_rows else {})},
        **tally.as_dict(),
    }


@dataclass
class RateWindow:
    """The crawl's outcomes per second, from its first outcome to the last look, against the
    mean sum of the limits (req/s) of the sites being crawled at each look."""
    first_at: float | None = None
    first_outcomes: int = 0
    last_at: float | None = None
    last_outcomes: int = 0
    limit_total: float = 0.0
    limit_looks: int = 0

    def look(self, at: float, outcomes: int, limit_sum: float | None) -> None:
        if self.first_at is None:
            if outcomes == 0:
                return  # not crawling yet: the stack's start is not the crawl's rate
            self.first_at, self.first_outcomes = at, outcomes
        self.last_at, self.last_outcomes = at, outcomes
        if limit_sum:
            self.limit_total += limit_sum
            self.limit_looks += 1

    def as_dict(self) -> dict[str, Any]:
        seconds = 0.0 if self.first_at is None or self.last_at is None else self.last_at - self.first_at
        rate = (self.last_outcomes - self.first_outcomes) / seconds if seconds > 0 else None
        limit = self.limit_total / self.limit_looks if self.limit_looks else None
        return {"outcomes_per_second": None if rate is None else round(rate, 2),
                "sites_limit_sum": None if limit is None else round(limit, 2),
                "ratio": None if rate is None or not limit else round(rate / limit, 3),
                "seconds": round(seconds, 1)}


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The printed summary of a ``Collector.summary()``."""
    totals = summary["totals"]
    rows = totals["rows"]

    def share(count: int) -> str:
        return f"{count:,} ({100 * count / rows:.1f}%)" if rows else f"{count:,}"

    lines = [f"rows read: {summary['rows_read']:,}; with an outcome: {rows:,}",
             f"successes: {share(totals['successes'])}",
             f"link rot (404, 410): {share(totals[LINK_ROT])}",
             f"errors: {share(totals['errors'])}, of which bad rows in the list: {totals['bad_rows']:,}"]
    for bad in totals["bad"][:10]:
        lines.append(f"  bad row: {bad['file']} row {bad['row']}: {bad['reason']}")
    if totals["bad_rows"] > 10:
        lines.append(f"  ... {totals['bad_rows'] - 10:,} more bad rows (stats.json and each shard's parquet)")
    if totals["by_reason"]:
        lines.append("errors by reason: " + ", ".join(f"{k} {v:,}" for k, v in list(totals["by_reason"].items())[:15]))
    if totals["by_http_status"]:
        lines.append("errors by HTTP status: " + ", ".join(f"{k} {v:,}" for k, v in totals["by_http_status"].items()))
    if totals["failures_by_site"]:
        lines.append(f"sites that failed most (link rot and errors, top {TOP_SITES}): " + ", ".join(
            f"{k} {v:,}" for k, v in totals["failures_by_site"].items()))
    opted_out = totals.get(OPTED_OUT) or {}
    if opted_out:
        lines.append(f"opted out by the site (not crawled): {share(sum(opted_out.values()))}: " + ", ".join(
            f"{k} {v:,}" for k, v in opted_out.items()))
    if totals["other_outcomes"]:
        lines.append("other outcomes: " + ", ".join(f"{k} {v:,}" for k, v in totals["other_outcomes"].items()))
    lines.append(f"waited for robots.txt: {totals['waited_for_robots']:,}; "
                 f"answered 429/503 (a Retry-After pause): {totals['waited_for_retry_after']:,}")
    rate = summary["rate"]
    if rate["outcomes_per_second"] is None:
        lines.append("rate: not measured (the crawl was too short)")
    elif rate["sites_limit_sum"] is None:
        lines.append(f"rate: {rate['outcomes_per_second']:,.1f} outcomes/s; the sites' limits were not read while "
                     "it crawled (Redis not reachable, or the crawl was shorter than one look, 5 s)")
    else:
        lines.append(f"rate: {rate['outcomes_per_second']:,.1f} outcomes/s against {rate['sites_limit_sum']:,.1f} "
                     f"req/s, the sum of the limits of the sites being crawled ({100 * rate['ratio']:.0f}%): "
                     "the politeness limits set the pace" if rate["ratio"] >= 0.8 else
                     f"rate: {rate['outcomes_per_second']:,.1f} outcomes/s against {rate['sites_limit_sum']:,.1f} "
                     f"req/s, the sum of the limits of the sites being crawled ({100 * rate['ratio']:.0f}%): "
                     "below the limits (workers, back-off or pauses set the pace)")
    return lines
