"""The halted line on a fake log: it reads urls_halted only when a source resumes, hands that
source's URLs back to urls, writes the others again for the next scan, and commits nothing it
has not placed."""
from __future__ import annotations

import asyncio
import json

from common.contracts import HALTED_URLS_TOPIC, REJECTED_TOPIC, URLS_TOPIC
from test.worker_fakes import FakeProducer
from worker.intake.feed import TP, Batch, Record
from worker.monitor_view import MonitorView
from worker.parking.hand_back_on_resume import HaltedLine, is_scan_marker, scan_marker

PARTS = [(HALTED_URLS_TOPIC, 0), (HALTED_URLS_TOPIC, 1)]


class LogProducer(FakeProducer):
    """What is sent to urls_halted lands at the end of its partition (by key: alternately)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: dict[TP, list[bytes]] = {tp: [] for tp in PARTS}
        self._keyed = 0

    async def send(self, topic: str, value: bytes, key=None, partition: int | None = None) -> None:
        await super().send(topic, value, key, partition)
        if topic == HALTED_URLS_TOPIC:
            if partition is None:
                partition, self._keyed = self._keyed % 2, self._keyed + 1
            self.log[(topic, partition)].append(value)

    def urls_on(self, topic: str) -> list[dict]:
        return [m for m in self.on(topic) if "halted_scan" not in m]


class LogFeed:
    """Partitions as growing lists; a consumer position per partition, pause, seek, commit."""

    def __init__(self, producer: LogProducer) -> None:
        self.log = producer.log
        self.position = dict.fromkeys(PARTS, 0)
        self.paused: set[TP] = set()
        self.committed: dict[TP, int] = {}
        self.assigned = False
        self.read = 0  # records handed to the line
        self._producer = producer

    def append(self, tp: TP, value: bytes) -> None:
        self.log[tp].append(value)

    async def subscribe(self, topics) -> None:
        assert topics == [HALTED_URLS_TOPIC]

    async def poll(self, max_records: int, timeout: float) -> Batch:
        await asyncio.sleep(0.01)
        batch = Batch()
        if not self.assigned:
            self.assigned, batch.assigned = True, list(PARTS)
            return batch
        for tp in PARTS:
            if tp in self.paused:
                continue
            while self.position[tp] < len(self.log[tp]) and len(batch.records) < max_records:
                batch.records.append(Record(tp[0], tp[1], self.position[tp], self.log[tp][self.position[tp]]))
                self.position[tp] += 1
        self.read += len(batch.records)
        return batch

    async def pause(self, parts) -> None:
        self.paused.update(parts)

    async def resume(self, parts) -> None:
        self.paused.difference_update(parts)

    async def seek(self, positions) -> None:
        self.position.update(positions)

    async def commit(self, positions) -> bool:
        self.committed.update(positions)
        return True

    async def close(self) -> None:
        pass


def url(source: str, n: int) -> bytes:
    return json.dumps({"url": f"http://{source}.example/{n}.jpg", "uuid": f"{source}-{n}", "source": source}).encode()


async def until(condition, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def test_a_resume_hands_back_that_source_and_keeps_the_others_waiting() -> None:
    producer = LogProducer()
    feed = LogFeed(producer)
    for n in range(30):  # two halted sources interleaved over both partitions
        feed.append(PARTS[n % 2], url("a" if n % 3 else "b", n))
    feed.append(PARTS[0], b"not json")
    view = MonitorView(halted={"a", "b"})
    line = HaltedLine(feed, producer, view)
    running = asyncio.create_task(line.run())
    try:
        # The first scan (a new owner) finds nothing to hand back: everything is written again.
        await until(lambda: line.parked_again == 30 and not line.scanning)
        assert not producer.on(URLS_TOPIC) and feed.paused == set(PARTS)
        assert feed.committed == {PARTS[0]: 17, PARTS[1]: 16}  # placed (and the markers), so committed
        read_after_scan = feed.read
        await asyncio.sleep(0.3)
        assert feed.read == read_after_scan  # between scans, nothing is read

        view.decide(halted={"a"})  # ctl resume b
        await until(lambda: len(producer.on(URLS_TOPIC)) == 10 and not line.scanning)
        assert sorted(m["uuid"] for m in producer.on(URLS_TOPIC)) == sorted(f"b-{n}" for n in range(0, 30, 3))
        assert {m["source"] for m in producer.urls_on(HALTED_URLS_TOPIC)} == {"a", "b"}  # b's from the first scan
        assert line.parked_again >= 50 and producer.on(REJECTED_TOPIC)[0]["raw"] == "not json"
        # Each partition's commit is just past its scan's marker, where the next scan starts.
        assert all(feed.committed[tp] == feed.position[tp] for tp in PARTS)
        assert all(is_scan_marker(feed.log[tp][feed.position[tp] - 1]) for tp in PARTS)
    finally:
        line.stop()
        await asyncio.wait_for(running, 5)


async def test_what_arrives_during_a_scan_is_left_for_the_next_one() -> None:
    """A record past the scan's marker is sought back to, never skipped; an older scan's
    marker is passed over."""
    producer = LogProducer()
    feed = LogFeed(producer)
    for value in (url("a", 0), scan_marker(), url("a", 2)):
        feed.append(PARTS[0], value)
    at_markers: list[tuple] = []  # at each scan's marker on PARTS[0]: handed back, committed, position, paused
    send = producer.send

    async def send_then_one_late(topic: str, value: bytes, key=None, partition: int | None = None) -> None:
        await send(topic, value, key, partition)
        if (topic, partition) == PARTS[0] and is_scan_marker(value):
            at_markers.append(([m["uuid"] for m in producer.on(URLS_TOPIC)], feed.committed.get(PARTS[0]),
                               feed.position[PARTS[0]], PARTS[0] in feed.paused))
            if len(at_markers) == 1:
                feed.append(PARTS[0], url("late", 4))  # parked just after the first scan's marker

    producer.send = send_then_one_late  # type: ignore[method-assign]
    line = HaltedLine(feed, producer, MonitorView())
    running = asyncio.create_task(line.run())
    try:
        await until(lambda: len(at_markers) >= 2 and len(producer.on(URLS_TOPIC)) == 3)
    finally:
        line.stop()
        await asyncio.wait_for(running, 5)
    # When the second scan began, the first had handed back only what came before its marker,
    # committed and sought to just past it (the late URL's offset), and paused the partition.
    assert at_markers[1] == (["a-0", "a-2"], 4, 4, True)
    assert [m["uuid"] for m in producer.on(URLS_TOPIC)] == ["a-0", "a-2", "late-4"]  # never skipped


async def test_a_scan_reads_to_its_marker_not_to_the_end_the_broker_reports() -> None:
    """tansu reports a partition's end as the first offset of its last batch: a scan read up to
    it left the rest of that batch (279 of 2,000 resumed URLs) until more were parked. The
    fake feed has no way to report an end at all."""
    producer = LogProducer()
    feed = LogFeed(producer)
    for n in range(20):
        feed.append(PARTS[0], url("b", n))
    line = HaltedLine(feed, producer, MonitorView())
    running = asyncio.create_task(line.run())
    try:
        await until(lambda: len(producer.on(URLS_TOPIC)) == 20)
    finally:
        line.stop()
        await asyncio.wait_for(running, 5)


async def test_a_url_parked_after_the_resume_by_a_worker_that_had_not_seen_it_goes_back(monkeypatch) -> None:
    """Other workers see a resume up to a refresh later and park its URLs meanwhile: the line
    scans again for a while after a resume, so they do not wait HALTED_RESCAN_SECONDS."""
    monkeypatch.setattr("worker.parking.hand_back_on_resume.HALTED_RESUME_RESCAN_SECONDS", 0.1)
    producer = LogProducer()
    feed = LogFeed(producer)
    feed.append(PARTS[0], url("b", 0))
    view = MonitorView(halted={"b"})
    line = HaltedLine(feed, producer, view)
    running = asyncio.create_task(line.run())
    try:
        await until(lambda: line.parked_again == 1 and not line.scanning)
        view.decide(halted=())
        await until(lambda: len(producer.on(URLS_TOPIC)) == 1 and not line.scanning)
        await asyncio.sleep(0.3)  # the resume's scans have ended
        feed.append(PARTS[1], url("b", 1))  # parked by a worker that still saw b halted
        await until(lambda: len(producer.on(URLS_TOPIC)) == 2, timeout=2)
    finally:
        line.stop()
        await asyncio.wait_for(running, 5)
