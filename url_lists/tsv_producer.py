"""``python -m url_lists.tsv_producer FILE.tsv KAFKA_HOSTS``: schedule a crawl from a TSV.

The TSV has a header row with (at least) ``url``, ``identifier`` and
``source``. Each good row becomes an ``inbound_images`` message; a bad row is
reported with its line number and skipped, so one typo does not cost a
million-row import. The exit status is non-zero if any message was not
acknowledged by the broker: a zero status means every good row is in Kafka.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from collections.abc import Iterator

from confluent_kafka import KafkaError, KafkaException, Message, Producer
from tqdm import tqdm

from common import contracts
from common.jsonlog import log_event
from common.kafka import ensure_topics, produce_waiting, producer_config
from common.settings import load_settings
from common.contracts import INBOUND_PARTITIONS

COLUMNS = ("url", "identifier", "source")


class BadFile(Exception):
    """The file as a whole cannot be read (missing, or no usable header)."""


def with_scheme(url: str) -> str:
    """``example.org/a.jpg`` and ``//example.org/a.jpg`` get ``http://``; anything else is left alone."""
    if url.startswith("//"):
        return "http:" + url
    return url if "://" in url else "http://" + url


def message_for(row: dict[str, str | None]) -> bytes:
    """The inbound message for one row, validated as the splitter will validate it."""
    url, identifier, source = (row.get(column) or "" for column in COLUMNS)
    if not (url.strip() and identifier.strip() and source.strip()):
        raise contracts.InvalidMessage("url, identifier and source must all be present")
    for value in (url, identifier, source):
        value.encode("utf-8")  # raises on the surrogates that stand for undecodable bytes
    message = json.dumps({"url": with_scheme(url.strip()), "uuid": identifier.strip(),
                          "source": source.strip()}).encode()
    contracts.parse_crawl_request(message)
    return message


def read_rows(path: Path) -> Iterator[tuple[int, bytes | None, str]]:
    """(line number, message or None, reason) for each data row."""
    # surrogateescape: a stray non-UTF-8 byte spoils its row, not the whole file.
    with path.open(encoding="utf-8", errors="surrogateescape", newline="") as lines:
        reader = csv.DictReader(lines, delimiter="\t", quoting=csv.QUOTE_NONE)
        missing = [column for column in COLUMNS if column not in (reader.fieldnames or [])]
        if missing:
            raise BadFile(f"{path}: the header row lacks {', '.join(missing)}")
        for row in reader:
            try:
                yield reader.line_num, message_for(row), ""
            except contracts.InvalidMessage as exc:
                yield reader.line_num, None, str(exc)
            except UnicodeEncodeError:
                yield reader.line_num, None, "the row is not valid UTF-8"


def produce_file(path: Path, hosts: str, partitions: int) -> dict[str, int]:
    """Send every good row; wait for every acknowledgement; return the counts."""
    counts = {"sent": 0, "failed": 0, "bad_rows": 0}

    def on_delivery(err: KafkaError | None, _message: Message) -> None:
        if err is not None:
            counts["failed"] += 1

    with path.open("rb") as raw:
        total = max(0, sum(1 for _ in raw) - 1)
    ensure_topics(hosts, [contracts.INBOUND_TOPIC], partitions)
    producer = Producer(producer_config(hosts))
    with tqdm(total=total, unit="rows", disable=not sys.stderr.isatty()) as progress:
        for line, message, reason in read_rows(path):
            progress.update(1)
            if message is None:
                counts["bad_rows"] += 1
                log_event(contracts.EVENT_TSV_BAD_ROW, file=str(path), line=line, error=reason)
                continue
            produce_waiting(producer, contracts.INBOUND_TOPIC, message, on_delivery=on_delivery)
            producer.poll(0)
            counts["sent"] += 1
    while producer.flush(10) > 0:  # message.timeout.ms bounds this: each message ends delivered or failed
        pass
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m url_lists.tsv_producer", description=__doc__.split("\n")[0])
    parser.add_argument("file", type=Path, metavar="FILE.tsv")
    parser.add_argument("kafka_hosts", metavar="KAFKA_HOSTS")
    args = parser.parse_args(argv)
    load_settings()  # a bad or replaced setting stops here, with one line
    partitions = INBOUND_PARTITIONS
    try:
        counts = produce_file(args.file, args.kafka_hosts, partitions)
    except (BadFile, OSError, KafkaException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log_event(contracts.EVENT_TSV_PRODUCED, file=str(args.file), delivered=counts["sent"] - counts["failed"], **counts)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
