"""librdkafka's own lines go through our JSON log, one event per kind per interval."""
from __future__ import annotations

import json
import time

from confluent_kafka import KafkaError, Producer

from common.contracts import EVENT_KAFKA_CLIENT_ERROR
from common.kafka import ClientLog, producer_config
from devstack.servers import free_port


def events(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_one_event_per_kind_per_interval_with_the_count_it_stood_for(capsys) -> None:
    now = [0.0]
    log = ClientLog(interval=10.0, clock=lambda: now[0])
    for second in range(25):
        now[0] = float(second)
        log.error_cb(KafkaError(KafkaError._TRANSPORT, "broker down"))
        log.logger.log(40, "%s [%s] %s", "FAIL", "rdkafka#producer-1", "Connect failed")
    log.logger.log(20, "%s [%s] %s", "INFO", "rdkafka#producer-1", "a notice, not worth a line")
    seen = events(capsys.readouterr().out)
    assert [(e["event"], e["kind"], e["suppressed"]) for e in seen] == [
        (EVENT_KAFKA_CLIENT_ERROR, "_TRANSPORT", 0), (EVENT_KAFKA_CLIENT_ERROR, "FAIL", 0),
        (EVENT_KAFKA_CLIENT_ERROR, "_TRANSPORT", 9), (EVENT_KAFKA_CLIENT_ERROR, "FAIL", 9),
        (EVENT_KAFKA_CLIENT_ERROR, "_TRANSPORT", 9), (EVENT_KAFKA_CLIENT_ERROR, "FAIL", 9)]
    assert seen[1]["reason"] == "Connect failed" and seen[1]["client"] == "rdkafka#producer-1"


def test_an_unreachable_broker_writes_json_not_librdkafka_text(capfd) -> None:
    """A real client against a closed port for 3 s: before, ~60 plain lines on stderr."""
    producer = Producer(producer_config(f"127.0.0.1:{free_port()}"))
    producer.produce("nowhere", b"x")
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        producer.poll(0.1)
    del producer
    out, err = capfd.readouterr()
    assert "%3|" not in err and "FAIL" not in err, err[:500]
    seen = [e for e in events(out) if e["event"] == EVENT_KAFKA_CLIENT_ERROR]
    assert seen, out[:500]
    kinds = [e["kind"] for e in seen]
    assert len(kinds) == len(set(kinds)), f"a kind repeated within the interval: {kinds}"
