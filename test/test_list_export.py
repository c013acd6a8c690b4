"""``python -m url_lists.export``: outcomes to one row per URL, Parquet or JSON lines, resumed."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
from confluent_kafka import Producer

from common import contracts
from common.kafka import ensure_topics, producer_config
from url_lists import export
from url_lists.results import Joiner
from test.test_list_producer import own_kafka  # noqa: F401 - the fixture

QUALITY = {"identifier": "a", "width": 640, "height": 480, "compression_quality": 85, "filesize": 1234,
           "x_robots_tag": []}


def test_an_exif_message_joins_its_quality_message() -> None:
    joiner = Joiner()
    meta = contracts.METADATA_TOPIC
    assert joiner.feed(meta, 0, 1, json.dumps({"identifier": "a", "exif": {"0x13b": "Alden"}}).encode()) is None
    row = joiner.feed(meta, 0, 2, json.dumps(QUALITY).encode())
    assert row == {"identifier": "a", "outcome": "success", "width": 640, "height": 480, "compression_quality": 85,
                   "filesize": 1234, "exif": '{"0x13b": "Alden"}', "x_robots_tag": [], "thumbnail_key": "a.jpg"}
    assert not joiner.pending
    hidden = joiner.feed(meta, 0, 3, json.dumps({**QUALITY, "identifier": "b", "x_robots_tag": ["noindex"]}).encode())
    assert hidden is not None and (hidden["exif"], hidden["thumbnail_key"]) == (None, None)
    error = joiner.feed(contracts.CRAWL_ERRORS_TOPIC, 1, 0, json.dumps(
        {"identifier": "c", "url": "https://x.example/c", "reason": "HTTP 500", "status": 500}).encode())
    assert error == {"identifier": "c", "outcome": "error", "reason": "HTTP 500", "status": 500,
                     "url": "https://x.example/c"}
    assert joiner.feed(contracts.LINK_ROT_TOPIC, 0, 0, b'{"identifier": "d"}') == {"identifier": "d",
                                                                                   "outcome": "link_rot"}
    opted = joiner.feed(contracts.OPTED_OUT_TOPIC, 2, 0, json.dumps(
        {"identifier": "e", "url": "https://x.example/photos/e.jpg", "signal": "tdmrep-file",
         "value": "/photos/* reserved", "status": None}).encode())
    assert opted == {"identifier": "e", "outcome": "opted_out", "status": None, "url": "https://x.example/photos/e.jpg",
                     "signal": "tdmrep-file", "signal_value": "/photos/* reserved"}
    for hostile in (b"", b"[]", b'{"identifier": 5}', b"\xff", b"[" * 100_000):
        assert joiner.feed(contracts.LINK_ROT_TOPIC, 0, 0, hostile) is None
    assert joiner.unreadable == 5


def send(hosts: str, messages: list[tuple[str, dict]]) -> None:
    producer = Producer(producer_config(hosts))
    for topic, message in messages:
        producer.produce(topic, json.dumps(message).encode(), key=message["identifier"])
    assert producer.flush(30) == 0


def test_export_writes_shards_and_resumes_without_repeats(own_kafka: str, tmp_path: Path, monkeypatch,  # noqa: F811
                                                          capsys) -> None:
    monkeypatch.setenv("KAFKA_HOSTS", own_kafka)
    ensure_topics(own_kafka, export.TOPICS, 4)
    first = [(contracts.METADATA_TOPIC, {**QUALITY, "identifier": f"q{n}"}) for n in range(5)]
    first += [(contracts.LINK_ROT_TOPIC, {"identifier": "gone"}),
              (contracts.METADATA_TOPIC, {"identifier": "late", "exif": {"0x9209": 0}})]  # its quality comes later
    send(own_kafka, first)
    out = tmp_path / "results"
    assert export.main([str(out), "--shard-rows", "4"]) == 0
    assert sorted(p.name for p in out.glob("part-*")) == ["part-00000.parquet", "part-00001.parquet"]
    send(own_kafka, [(contracts.METADATA_TOPIC, {**QUALITY, "identifier": "late"}),
                     (contracts.CRAWL_ERRORS_TOPIC, {"identifier": "bad", "reason": "Timeout", "status": None}),
                     (contracts.OPTED_OUT_TOPIC, {"identifier": "no", "url": "https://x.example/n.jpg",
                                                  "signal": "x-robots-tag", "value": "noai", "status": 200})])
    assert export.main([str(out)]) == 0                      # resumes: only the new outcomes
    table = pq.read_table(out)
    rows = {row["identifier"]: row for row in table.to_pylist()}
    assert table.num_rows == len(rows) == 9
    assert (rows["no"]["outcome"], rows["no"]["signal"], rows["no"]["signal_value"], rows["no"]["status"]) == (
        "opted_out", "x-robots-tag", "noai", 200)
    assert rows["late"]["exif"] == '{"0x9209": 0}' and rows["gone"]["outcome"] == "link_rot"
    assert (rows["bad"]["outcome"], rows["bad"]["reason"], rows["bad"]["status"]) == ("error", "Timeout", None)
    assert export.main([str(tmp_path / "lines"), "--output-format", "jsonl"]) == 0
    lines = [json.loads(line) for path in sorted((tmp_path / "lines").glob("part-*.jsonl"))
             for line in path.read_text().splitlines()]
    assert len(lines) == 9 and next(r for r in lines if r["identifier"] == "late")["exif"] == {"0x9209": 0}
