"""URL lists in every input format, row numbers, bad rows and sites, without servers."""
from __future__ import annotations

import csv
import json
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common import contracts
from url_lists import readers
from url_lists.readers import BadFile, Columns, expand, format_of, read_batches
from url_lists.rows import convert_batch, derived_identifier, row_message, url_origin_of
from url_lists.sites import site_of_host

ROWS = [("https://a.example/1.jpg", "id-1", "Flickr"),
        ("b.example/2.jpg", "id-2", "met"),
        ("https://c.example/\"q\".jpg", "id-3", "met")]
COLUMNS = Columns(url="url", id="key", source="src")


def write(tmp_path: Path, kind: str, rows=ROWS) -> Path:
    """The same rows (plus a caption column the reader must ignore) in ``kind``."""
    path = tmp_path / f"list.{kind}"
    records = [{"url": u, "key": i, "caption": "a, \"quoted\" caption", "src": s} for u, i, s in rows]
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(records), path, row_group_size=2)
    elif kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif kind == "json":
        path.write_text(json.dumps(records, indent=2))
    elif kind == "txt":
        path.write_text("".join(u + "\n" for u, _, _ in rows))
    elif kind == "tsv":  # quotes are data in a TSV
        path.write_text("url\tkey\tcaption\tsrc\n" + "".join(f"{u}\t{i}\ta caption\t{s}\n" for u, i, s in rows))
    else:
        with path.open("w", newline="") as out:
            writer = csv.DictWriter(out, ["url", "key", "caption", "src"])
            writer.writeheader()
            writer.writerows(records)
    return path


def rows_of(path: Path, kind: str, columns: Columns = COLUMNS, skip: int = 0) -> list[tuple[int, object]]:
    out = []
    for batch in read_batches(path, kind, columns, skip):
        for index, values in enumerate(batch.values):
            if values is not None or index in batch.errors:  # None alone: a blank line
                out.append((batch.first_row + index, values if values is not None else batch.errors[index]))
    return out


@pytest.mark.parametrize("kind", ["csv", "tsv", "json", "jsonl", "parquet"])
def test_each_format_gives_the_same_numbered_rows(tmp_path: Path, kind: str) -> None:
    path = write(tmp_path, kind)
    assert format_of(path, None) == kind
    assert rows_of(path, kind) == [(n, row) for n, row in enumerate(ROWS, 1)]
    assert rows_of(path, kind, skip=2) == [(3, ROWS[2])]  # a resume passes over what was produced


def test_a_txt_list_is_one_url_a_line_numbered_by_line(tmp_path: Path) -> None:
    path = tmp_path / "urls.txt"
    path.write_text("https://a.example/1.jpg\n\n  b.example/2.jpg  \n")
    assert rows_of(path, "txt", Columns()) == [(1, ("https://a.example/1.jpg", None, None)),
                                              (3, ("b.example/2.jpg", None, None))]


def test_a_broken_jsonl_line_is_a_bad_row_and_the_rest_is_read(tmp_path: Path) -> None:
    path = tmp_path / "list.jsonl"
    path.write_text('{"url": "https://a.example/1.jpg"}\n{"url": \n[1, 2]\n\n{"url": "https://a.example/5.jpg"}\n')
    rows = rows_of(path, "jsonl", Columns())
    assert [n for n, _ in rows] == [1, 2, 3, 5]
    assert "not JSON" in rows[1][1] and "JSON object" in rows[2][1]


def test_a_json_array_is_read_an_element_at_a_time(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(readers, "JSON_CHUNK", 7)  # every element straddles a read
    path = tmp_path / "list.json"
    records = [{"url": f"https://a.example/{n}.jpg", "n": 123456789 * n} for n in range(1, 40)]
    path.write_text(json.dumps(records))
    assert [values[0] for _, values in rows_of(path, "json", Columns())] == [r["url"] for r in records]
    (tmp_path / "object.json").write_text('{"url": "x"}')
    with pytest.raises(BadFile, match="array"):
        rows_of(tmp_path / "object.json", "json", Columns())


def test_a_csv_with_a_missing_column_or_short_row(tmp_path: Path) -> None:
    path = tmp_path / "list.csv"
    path.write_text("url,caption\nhttps://a.example/1.jpg,one\nhttps://a.example/2.jpg\n")
    assert rows_of(path, "csv", Columns(url="url")) == [(1, ("https://a.example/1.jpg", None, None)),
                                                       (2, ("https://a.example/2.jpg", None, None))]
    with pytest.raises(BadFile, match="lacks key"):
        rows_of(path, "csv", Columns(url="url", id="key"))
    parquet = write(tmp_path, "parquet")
    with pytest.raises(BadFile, match="no column URL"):
        rows_of(parquet, "parquet", Columns(url="URL"))


def test_paths_globs_and_folders(tmp_path: Path) -> None:
    for name in ("b.parquet", "a.parquet", "c.csv"):
        (tmp_path / name).write_text("")
    assert expand([str(tmp_path / "*.parquet")], None) == [tmp_path / "a.parquet", tmp_path / "b.parquet"]
    assert expand([str(tmp_path)], "csv") == [tmp_path / "c.csv"]
    with pytest.raises(BadFile):
        expand([str(tmp_path / "none-*.txt")], None)
    with pytest.raises(BadFile):
        format_of(tmp_path / "list.dat", None)


@pytest.mark.parametrize("host, site", [
    ("img1.site7.co.uk", "site7.co.uk"), ("site7.co.uk", "site7.co.uk"), ("a.b.example.com", "example.com"),
    ("alice.github.io", "alice.github.io"),    # the private section: each user's site is its own
    ("github.io", "github.io"), ("localhost", "localhost"), ("xn--bcher-kva.example", "xn--bcher-kva.example"),
    ("127.0.0.11", "127.0.0.11"), ("2001:db8::1", "2001-db8--1"),
])
def test_a_source_is_the_registrable_domain(host: str, site: str) -> None:
    assert site_of_host(host) == site
    contracts.validate_source(site)


def test_rows_become_messages_or_bad_rows_with_reasons() -> None:
    values = [("IMG.Site7.co.uk/a.jpg", None, None),              # no scheme: http://
              ("https://bücher.example/x.jpg", None, None),        # IDNA host
              ("ftp://a.example/x", None, None), ("https://a.example/a b.jpg", None, None),
              (None, None, None), (17, None, None), None, ("https://[::1/x", None, None)]
    converted = convert_batch(values, {6: "not JSON"}, 10, False, False)
    assert converted.rows == [10, 11]
    assert [json.loads(m) for m in converted.messages] == [
        {"url": "http://IMG.Site7.co.uk/a.jpg", "uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, "http://IMG.Site7.co.uk/a.jpg")),
         "source": "site7.co.uk"},
        {"url": "https://bücher.example/x.jpg", "uuid": derived_identifier("https://bücher.example/x.jpg"),
         "source": "xn--bcher-kva.example"}]
    for message in converted.messages:
        contracts.parse_crawl_request(message)
    assert [row for row, _ in converted.bad] == [12, 13, 14, 15, 16, 17]
    reasons = dict(converted.bad)
    assert "http or https" in reasons[12] and "whitespace" in reasons[13] and reasons[14] == "no url"
    assert "text" in reasons[15] and reasons[16] == "not JSON"


def test_identifier_and_source_columns() -> None:
    message, source = row_message("https://a.example/1.jpg", 42, "Flickr", True, True)
    assert json.loads(message) == {"url": "https://a.example/1.jpg", "uuid": "42", "source": "flickr"}
    for identifier, src, reason in [("", "flickr", "uuid"), ("x" * 201, "flickr", "uuid"),
                                    (None, "flickr", "no identifier"), ("id", "bad source!", "source"),
                                    ("id", None, "no source"), (True, "f", "text")]:
        with pytest.raises(contracts.InvalidMessage, match=reason):
            row_message("https://a.example/1.jpg", identifier, src, True, True)


SPELLINGS = [
    "http://a.example/x", "https://A.Example:8443/x?y#z", "http://a.example", "http://a.example?x",
    "http://a.example#f", "http://a.example:8080#x", "http://127.0.0.1/x", "http://0x7f.1/x", "http://2130706433/x",
    "http://127.1/", "http://0177.0.0.1/", "http://1.2.3.4.5/", "http://256.0.0.1/", "http://a..b/x",
    "http://-a.example/", "http://a-.example/", "http://a.example:99999/", "http://a.example:65536/",
    "http://a.example:65535/", "http://a.example:0/", "http://a.example:/x", "http://a.example.:80/x",
    "http://a.example\\@evil.test/", "http://a.example/\\@evil.test", "http://a.example/@evil.test",
    "http://evil.test@a.example/", "http://a.example%2f@evil.test/", "HTTP://a.example/", "http://a.example/%zz",
    "http://a.example/[x]", "http://a.example/?q=[::1]", "http://a.example/é", "https://xn--bcher-kva.example/",
    "http://a_b.example/", "http://[::1]:80/", "http://a.example:80:80/", "http://a.example:8o/",
    "http://a.example\t/", "http://" + "a" * 64 + ".example/", "http://a.example/" + "x" * 2100,
]


@pytest.mark.parametrize("url", SPELLINGS)
def test_a_plainly_written_origin_is_read_as_the_whole_url_is(url: str) -> None:
    """The producer reads a plain origin once per prefix; it must say what url_origin says of
    the whole URL (the same origin, or a refusal)."""
    def reading(read):
        try:
            return read(url)
        except contracts.InvalidMessage:
            return "refused"
    assert reading(url_origin_of) == reading(contracts.url_checked_origin)
