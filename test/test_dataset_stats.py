"""Stats arithmetic, the summary text and the JPEG size reader (url_lists.dataset.stats, images)."""
from __future__ import annotations

import pytest

from test.dataset_fakes import jpeg
from url_lists.dataset.images import jpeg_size
from url_lists.dataset.stats import MAX_SITES, RateWindow, Tally, shard_stats, summary_lines

SUCCESS = {"status": "success"}
ROT = {"status": "link_rot"}


def err(reason: str, status: int | None = None, **extra: object) -> dict[str, object]:
    return {"status": "error", "error_message": reason, "http_status": status, **extra}


@pytest.mark.parametrize("outcomes, expected", [
    ([], dict(rows=0, successes=0, link_rot=0, errors=0, bad_rows=0)),
    ([(SUCCESS, None)] * 3, dict(rows=3, successes=3, link_rot=0, errors=0, bad_rows=0)),
    ([(ROT, "a.test"), (err("HTTP 403", 403), "a.test"), (err("Timeout"), "b.test")],
     dict(rows=3, successes=0, link_rot=1, errors=2, bad_rows=0)),
    ([(err("no url", bad=True, source_file="l.csv", source_row=7), None), (SUCCESS, None)],
     dict(rows=2, successes=1, link_rot=0, errors=1, bad_rows=1)),
])
def test_a_tally_counts_each_outcome_once(outcomes: list, expected: dict) -> None:
    tally = Tally()
    for outcome, site in outcomes:
        tally.add(outcome, site)
    got = tally.as_dict()
    assert {k: got[k] for k in expected} == expected
    assert got["successes"] + got["link_rot"] + got["errors"] + sum(got["other_outcomes"].values()) == got["rows"]


def test_errors_by_reason_status_and_site() -> None:
    tally = Tally()
    for outcome, site in [(err("HTTP 403", 403), "a.test"), (err("HTTP 403", 403), "a.test"), (ROT, "b.test"),
                          (err("Timeout"), "c.test"), (err("bad", bad=True, source_file="f", source_row=2), None),
                          (SUCCESS, "a.test")]:
        tally.add(outcome, site)
    got = tally.as_dict()
    assert got["by_reason"] == {"HTTP 403": 2, "Timeout": 1}  # a bad row is listed with its file and row
    assert got["by_http_status"] == {"403": 2}
    assert got["failures_by_site"] == {"a.test": 2, "b.test": 1, "c.test": 1}  # a success is not a failure
    assert got["bad"] == [{"file": "f", "row": 2, "reason": "bad"}]


def test_shards_merge_into_the_crawls_totals() -> None:
    one, two, total = Tally(), Tally(), Tally()
    for outcome, site in [(SUCCESS, None), (err("HTTP 404", 404), "a.test")]:
        one.add(outcome, site)
    for outcome, site in [(ROT, "a.test"), (err("Timeout", None, robots_wait=True), "b.test")]:
        two.add(outcome, site)
    for shard in (one, two):
        total.merge(shard_stats(shard, 0.0, 1.0))
    got = total.as_dict()
    assert (got["rows"], got["successes"], got["link_rot"], got["errors"], got["waited_for_robots"]) == (4, 1, 1, 2, 1)
    assert got["failures_by_site"] == {"a.test": 2, "b.test": 1}
    stats = shard_stats(one, 10.0, 12.5)
    assert (stats["count"], stats["successes"], stats["failed_to_download"], stats["duration"]) == (2, 1, 1, 2.5)


def test_the_sites_counter_is_bounded() -> None:
    tally = Tally()
    tally.add(err("x"), "top.test")
    tally.add(err("x"), "top.test")
    for n in range(MAX_SITES * 3):
        tally.add(err("x"), f"s{n}.test")
    assert len(tally.failures_by_site) <= MAX_SITES
    assert tally.as_dict(top_sites=1)["failures_by_site"] == {"top.test": 2}


@pytest.mark.parametrize("looks, rate, limit, ratio", [
    ([(0, 0, None), (5, 0, 10.0)], None, None, None),                 # no outcome yet: not crawling
    ([(0, 0, None), (5, 50, 20.0), (15, 250, 20.0)], 20.0, 20.0, 1.0),  # from the first outcome
    ([(0, 10, 40.0), (10, 110, None), (20, 210, 20.0)], 10.0, 30.0, 0.333),
])
def test_the_rate_is_outcomes_per_second_against_the_limits(looks: list, rate: float | None,
                                                            limit: float | None, ratio: float | None) -> None:
    window = RateWindow()
    for at, outcomes, limit_sum in looks:
        window.look(at, outcomes, limit_sum)
    got = window.as_dict()
    assert (got["outcomes_per_second"], got["sites_limit_sum"], got["ratio"]) == (rate, limit, ratio)


def test_the_summary_says_what_a_dataset_builder_asks() -> None:
    tally = Tally()
    for outcome, site in [(SUCCESS, None), (ROT, "a.test"), (err("HTTP 403", 403), "a.test"),
                          (err("no url", bad=True, source_file="list.csv", source_row=9), None)]:
        tally.add(outcome, site)
    window = RateWindow()
    window.look(0, 1, 10.0)
    window.look(10, 41, 10.0)
    lines = summary_lines({"rows_read": 4, "totals": tally.as_dict(), "waits_recorded": False,
                           "rate": window.as_dict()})
    text = "\n".join(lines)
    assert "rows read: 4" in text and "successes: 1 (25.0%)" in text and "link rot (404, 410): 1 (25.0%)" in text
    assert "bad row: list.csv row 9: no url" in text
    assert "errors by HTTP status: 403 1" in text and "a.test 2" in text
    assert "4.0 outcomes/s against 10.0 req/s" in text and "(40%)" in text


@pytest.mark.parametrize("size", [(1, 1), (32, 24), (640, 480), (17, 999)])
def test_a_jpegs_size_is_read_from_its_header(size: tuple[int, int]) -> None:
    assert jpeg_size(jpeg(*size)) == size


@pytest.mark.parametrize("data", [b"", b"\xff\xd8", b"GIF89a", b"\xff\xd8\xff\xe0\x00\x01",
                                  b"\xff\xd8\x00\x00\x00\x00"])
def test_anything_else_has_no_size(data: bytes) -> None:
    assert jpeg_size(data) is None
