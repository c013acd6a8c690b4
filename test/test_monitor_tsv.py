"""The TSV producer's rows, schemes and exit status, on a fake producer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from url_lists import tsv_producer
from url_lists.tsv_producer import read_rows, with_scheme
from test.test_monitor_fakes import FakeProducer


@pytest.mark.parametrize("url, expected", [
    ("example.org/a.jpg", "http://example.org/a.jpg"),
    ("//example.org/a.jpg", "http://example.org/a.jpg"),
    ("https://example.org/a.jpg", "https://example.org/a.jpg"),
    ("http://example.org/a.jpg", "http://example.org/a.jpg"),
])
def test_a_missing_scheme_becomes_http(url: str, expected: str) -> None:
    assert with_scheme(url) == expected


def test_rows_carry_their_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "in.tsv"
    path.write_text("url\tidentifier\tsource\n"
                    "a.example/1.jpg\tid-1\tFlickr\n"
                    "\tid-2\tflickr\n"
                    "a.example/3.jpg\tid-3\tflickr\textra\tcolumns\n"
                    'a.example/"4".jpg\tid-4\tflickr\n')
    rows = list(read_rows(path))
    assert [(line, message is not None) for line, message, _ in rows] == [(2, True), (3, False), (4, True), (5, True)]
    assert json.loads(rows[0][1]) == {"url": "http://a.example/1.jpg", "uuid": "id-1", "source": "Flickr"}
    assert json.loads(rows[3][1])["url"] == 'http://a.example/"4".jpg'  # quotes are data in a TSV
    assert "present" in rows[1][2]


@pytest.mark.parametrize("failures, status", [(0, 0), (1, 1)])
def test_the_exit_status_says_whether_every_row_was_delivered(
        tmp_path: Path, monkeypatch, capsys, failures: int, status: int) -> None:
    path = tmp_path / "in.tsv"
    path.write_text("url\tidentifier\tsource\nhttps://a.example/1.jpg\tid-1\tflickr\n"
                    "https://a.example/2.jpg\tid-2\tflickr\nnot a url\tid-3\tflickr\n")
    producer = FakeProducer(fail_first=failures, buffer_errors=1)
    monkeypatch.setattr(tsv_producer, "Producer", lambda config: producer)
    monkeypatch.setattr(tsv_producer, "ensure_topics", lambda *args: None)
    assert tsv_producer.main([str(path), "127.0.0.1:9"]) == status
    final = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (final["sent"], final["failed"], final["bad_rows"], final["delivered"]) == (2, failures, 1, 2 - failures)


def test_a_missing_file_is_one_line_not_a_traceback(tmp_path: Path, capsys) -> None:
    assert tsv_producer.main([str(tmp_path / "nope.tsv"), "127.0.0.1:9"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
