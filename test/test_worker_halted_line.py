"""The halted line on a fake log: it reads urls_halted only when a source resumes, hands that
source's URLs back to urls, writes the others again for the next scan, and commits nothing it
has not placed."""
from __future__ import annotations

import asyncio
import json

from common.contracts import HALTED_URLS_TOPIC, REJECTED_TOPIC, URLS_TOPIC
from test.worker_fakes import FakeProducer
from worker.feed import TP, Batch, Record
from worker.halted_line import HaltedLine

PARTS = [(HALTED_URLS_TOPIC, 0), (HALTED_URLS_TOPIC, 1)]


class LogFeed:
    """Partitions as growing lists; a consumer position per partition, pause, seek, commit."""

    def __init__(self, producer: FakeProducer) -> None:
        self.log: dict[TP, list[bytes]] = {tp: [] for tp in PARTS}
        self.position = dict.fromkeys(PARTS, 0)
        self.paused: set[TP] = set()
        self.committed: dict[TP, int] = {}
        self.assigned = False
        self.read = 0  # records handed to the line
        self._producer = producer

    def append(self, tp: TP, value: bytes) -> None:
        self.log[tp].append(value)

    def drain_producer(self) -> None:
        """What the line wrote to urls_halted lands at the end of a partition."""
        for n, (topic, message) in enumerate(self._producer.sent):
            if topic == HALTED_URLS_TOPIC and not message.get("_landed"):
                message["_landed"] = True
                self.append(PARTS[n % 2], json.dumps({k: v for k, v in message.items() if k != "_landed"}).encode())

    async def subscribe(self, topics) -> None:
        assert topics == [HALTED_URLS_TOPIC]

    async def poll(self, max_records: int, timeout: float) -> Batch:
        await asyncio.sleep(0.01)
        self.drain_producer()
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

    async def high_watermarks(self, parts) -> dict[TP, int]:
        return {tp: len(self.log[tp]) for tp in parts}

    async def seek(self, positions) -> None:
        self.position.update(positions)

    async def positions(self, parts) -> dict[TP, int]:
        return {tp: self.position[tp] for tp in parts}

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
    producer = FakeProducer()
    feed = LogFeed(producer)
    for n in range(30):  # two halted sources interleaved over both partitions
        feed.append(PARTS[n % 2], url("a" if n % 3 else "b", n))
    feed.append(PARTS[0], b"not json")
    halted = {"a", "b"}
    line = HaltedLine(feed, producer, lambda: frozenset(halted))
    running = asyncio.create_task(line.run())
    try:
        # The first scan (a new owner) finds nothing to hand back: everything is written again.
        await until(lambda: line.parked_again == 30 and not line._scan_ends)
        assert not producer.on(URLS_TOPIC) and feed.paused == set(PARTS)
        assert feed.committed == {PARTS[0]: 16, PARTS[1]: 15}  # placed, so committed
        read_after_scan = feed.read
        await asyncio.sleep(0.3)
        assert feed.read == read_after_scan  # between scans, nothing is read

        halted.discard("b")  # ctl resume b
        await until(lambda: len(producer.on(URLS_TOPIC)) == 10 and not line._scan_ends)
        assert sorted(m["uuid"] for m in producer.on(URLS_TOPIC)) == sorted(f"b-{n}" for n in range(0, 30, 3))
        assert {m["source"] for m in producer.on(HALTED_URLS_TOPIC)} == {"a", "b"}  # b's from the first scan
        assert line.parked_again >= 50 and producer.on(REJECTED_TOPIC)[0]["raw"] == "not json"
        # Each partition's commit is at the end of what was there when the scan began.
        assert all(feed.committed[tp] == feed.position[tp] for tp in PARTS)
    finally:
        line.stop()
        await asyncio.wait_for(running, 5)


async def test_what_arrives_during_a_scan_is_left_for_the_next_one() -> None:
    """A record past its partition's end-at-scan-start is sought back to, never skipped."""
    producer = FakeProducer()
    feed = LogFeed(producer)
    feed.append(PARTS[0], url("a", 0))
    line = HaltedLine(feed, producer, lambda: frozenset())
    line._scan_ends = {PARTS[0]: 1}
    feed.assigned = True
    feed.append(PARTS[0], url("late", 1))  # written after the scan began
    await line._scan([Record(*PARTS[0], 0, url("a", 0)), Record(*PARTS[0], 1, url("late", 1))], frozenset())
    assert [m["uuid"] for m in producer.on(URLS_TOPIC)] == ["a-0"]
    assert feed.committed == {PARTS[0]: 1} and feed.position[PARTS[0]] == 1 and PARTS[0] in feed.paused
