"""In-process stand-ins for the worker's Redis, Kafka, S3 and politeness gate."""
from __future__ import annotations

import asyncio
import io
import json
import os
import select
import signal
import socket
import struct
import time
import zlib
from contextlib import asynccontextmanager
from typing import Any

from aiohttp.abc import AbstractResolver
from PIL import Image, TiffImagePlugin

from worker.intake.feed import Batch, Record
from worker.politeness import Refused


class FakeRedis:
    """The handful of commands the worker uses, on dicts; values are str like decode_responses."""

    def __init__(self) -> None:
        self.store: dict[str, Any] = {}
        self.calls: list[tuple] = []

    async def decr(self, key: str) -> int:
        self.calls.append(("decr", key))
        return self._incrby(key, -1)

    async def incr(self, key: str) -> int:
        return self._incrby(key, 1)

    async def set(self, key: str, value: Any, px: int | None = None) -> bool:
        self.store[key] = str(value)
        return True

    def register_script(self, script: str):
        """The worker's scripts (tokens.PACED_DECR, stats.RECORD and ANSWERED), run in Python on the same keys."""
        from worker.outcomes.stats import ANSWERED, RECORD
        from worker.fetching.tokens import PACED_DECR
        if script == RECORD:
            return self._record
        if script == ANSWERED:
            return self._answered
        assert script == PACED_DECR, "FakeRedis knows only the worker's paced DECR and stats scripts"

        async def paced_decr(keys: list[str], args: list[str]) -> list:
            pace, bucket, requests, log, granted = keys
            interval, tolerance, window = float(args[0]), float(args[1]), float(args[3])
            length = int(args[2])
            now = time.time()  # the script reads Redis's clock
            sent: list[float] = self.store.setdefault(log, [])  # newest first

            def ready(due: float) -> float:
                return max(due - tolerance, sent[length - 1] + window) if length and len(sent) >= length \
                    else due - tolerance
            due = float(self.store.get(pace, 0))
            if ready(due) > now:
                return [1, 0, str(ready(due) - now), self.store.get(granted, "")]
            left = await self.decr(bucket) if bucket in self.store else -1  # no bucket: no key made
            if left >= 0:
                self._incrby(requests, 1)
                due = max(due, now) + interval
                self.store[pace] = str(due)
                if length:
                    sent.insert(0, now)
                    del sent[length:]
            return [0, left, str(max(0.0, ready(due) - now)), self.store.get(granted, "")]
        return paced_decr

    async def _answered(self, keys: list[str], args: list) -> int:
        """stats.ANSWERED's commands, through the fake pipeline."""
        pipe = FakePipeline(self)
        pipe.hincrby(keys[0], args[0], 1)
        if str(args[1]) != "0":
            pipe.expire(keys[0], int(args[1]))
        pipe.zadd(keys[1], {args[3]: float(args[2])}, gt=True)
        await pipe.execute()
        return 0

    async def _record(self, keys: list[str], args: list) -> list:
        """stats.RECORD's commands, through the fake pipeline."""
        pipe = FakePipeline(self)
        now, windows = float(args[0]), int(args[9])
        pipe.zadd(keys[0], {args[1]: now}, gt=True)
        if str(args[2]) == "1":
            fields = str(args[7]).split()
            for field in fields:
                pipe.hincrby(keys[3], field, 1)
            if fields and str(args[8]) != "0":
                pipe.expire(keys[3], int(args[8]))
            if args[4] != "":
                pipe.zadd(keys[1], {args[4]: now})
            if args[5] != "":
                pipe.zremrangebyscore(keys[1], "-inf", float(args[5]))
                pipe.expire(keys[1], int(args[12]))
            for i in range(windows):
                pipe.hincrby(keys[5 + i], args[14 + 2 * i], 1)
                if str(args[15 + 2 * i]) != "0":
                    pipe.expire(keys[5 + i], int(args[15 + 2 * i]))
            pipe.rpush(keys[2], args[3])
            pipe.ltrim(keys[2], -int(args[6]), -1)
        if str(args[11]) == "1":
            pipe.incr(keys[4])
        counters = keys[5 + windows:]
        if str(args[10]) == "2":  # opted out: counted per signal
            for key in counters[:2]:
                pipe.hincrby(key, args[14 + 2 * windows], 1)
            await pipe.execute()
            return []
        for key in counters[:2 if str(args[10]) == "1" else 3]:
            pipe.incr(key)
        if str(args[10]) != "1":
            pipe.sadd(counters[3], args[3])
        await pipe.execute()
        return []

    async def get(self, key: str) -> str | None:
        self.calls.append(("get", key))
        return self.store.get(key)

    async def mget(self, keys: list[str]) -> list[str | None]:
        self.calls.append(("mget", *keys))
        return [self.store.get(k) if isinstance(self.store.get(k), str) else None for k in keys]

    async def smembers(self, key: str) -> set[str]:
        return set(self.store.get(key, set()))

    async def sadd(self, key: str, *members: str) -> None:
        self.store.setdefault(key, set()).update(members)

    async def srem(self, key: str, *members: str) -> None:
        self.store.setdefault(key, set()).difference_update(members)

    async def hget(self, key: str, field: str) -> str | None:
        value = self.store.get(key, {}).get(field)
        return None if value is None else str(value)

    async def zadd(self, key: str, mapping: dict[str, float], gt: bool = False) -> int:
        scores = self.store.setdefault(key, {})
        for member, score in mapping.items():
            scores[member] = max(score, scores.get(member, score)) if gt else score
        return len(mapping)

    def pipeline(self, transaction: bool = True) -> FakePipeline:
        return FakePipeline(self)

    def _incrby(self, key: str, amount: int) -> int:
        value = int(self.store.get(key, 0)) + amount
        self.store[key] = str(value)
        return value

    def integer(self, key: str) -> int:
        return int(self.store.get(key, 0))


class FakePipeline:
    def __init__(self, redis: FakeRedis):
        self._redis = redis
        self._ops: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str):
        def queue(*args, **kwargs):
            self._ops.append((name, args + tuple(kwargs.items())))
            return self
        return queue

    async def execute(self) -> list[Any]:
        results = []
        store = self._redis.store
        for name, args in self._ops:
            if name == "zadd":
                key, mapping, *options = args
                zset = store.setdefault(key, {})
                if ("gt", True) in options:
                    mapping = {m: s for m, s in mapping.items() if s > zset.get(m, float("-inf"))}
                zset.update(mapping)
                results.append(len(mapping))
            elif name == "hget":
                value = store.get(args[0], {}).get(args[1])
                results.append(None if value is None else str(value))
            elif name == "hmget":
                values = [store.get(args[0], {}).get(field) for field in args[1]]
                results.append([None if value is None else str(value) for value in values])
            elif name == "zremrangebyscore":
                key, _low, high = args
                zset = store.setdefault(key, {})
                for member in [m for m, score in zset.items() if score <= high]:
                    del zset[member]
                results.append(0)
            elif name == "rpush":
                store.setdefault(args[0], []).append(args[1])
                results.append(len(store[args[0]]))
            elif name == "ltrim":
                key, start, _end = args
                store[key] = store[key][start:]
                results.append(True)
            elif name == "incr":
                results.append(self._redis._incrby(args[0], 1))
            elif name == "hincrby":
                key, field, amount = args
                counts = store.setdefault(key, {})
                counts[field] = counts.get(field, 0) + amount
                results.append(counts[field])
            elif name == "expire":
                results.append(True)
            elif name == "sadd":
                members = store.setdefault(args[0], set())
                results.append(len(set(args[1:]) - members))
                members.update(args[1:])
            elif name == "smembers":
                results.append(set(store.get(args[0], set())))
            elif name == "zrange":
                zset = store.get(args[0], {})
                results.append(sorted(zset, key=zset.__getitem__))
            else:
                raise NotImplementedError(name)
        return results


class FakeProducer:
    """Records sends; the first ``fail_first`` sends raise, as a broker outage would."""

    def __init__(self, fail_first: int = 0):
        self.sent: list[tuple[str, dict]] = []
        self._failures_left = fail_first

    async def send(self, topic: str, value: bytes, key: Any = None, partition: int | None = None) -> None:
        if self._failures_left > 0:
            self._failures_left -= 1
            raise RuntimeError("broker unavailable")
        self.sent.append((topic, json.loads(value)))

    def on(self, topic: str) -> list[dict]:
        return [value for t, value in self.sent if t == topic]


class FakeThumbnails:
    def __init__(self) -> None:
        self.stored: dict[str, bytes] = {}

    async def put(self, uuid: str, jpeg: bytes) -> None:
        self.stored[uuid] = jpeg


class AllowAllGate:
    """A RequestGate that allows everything except URLs listed in ``refuse`` (url -> reason)."""

    def __init__(self, refuse: dict[str, str] | None = None):
        self.refuse = refuse or {}
        self.calls: list[tuple[str, str]] = []

    async def before_request(self, url: str, source: str) -> None:
        self.calls.append(("before_request", url))
        if url in self.refuse:
            raise Refused(self.refuse[url])

    @asynccontextmanager
    async def host_slot(self, url: str):
        self.calls.append(("host_slot", url))
        yield

    async def after_response(self, url: str, source: str, status: int, headers) -> None:
        self.calls.append(("after_response", url))


class FakeFeed:
    """A consumer on a fixed set of records: assigns their partitions on the first poll."""

    def __init__(self, records: list[Record], batch_size: int = 1000):
        self.records = list(records)
        self.batch_size = batch_size
        self.assigned_once = False
        self.paused: set[tuple[str, int]] = set()
        self.pauses = 0  # pause calls that paused anything
        self.commits: list[dict[tuple[str, int], int]] = []
        self.subscriptions: list[list[str]] = []
        self.revoking: list[tuple[str, int]] = []
        self.delivered: list[Record] = []  # what polls handed out, for a seek to read again
        self.seeks: list[dict[tuple[str, int], int]] = []

    async def subscribe(self, topics: list[str]) -> None:
        self.subscriptions.append(topics)

    async def seek(self, positions) -> None:
        """Each partition read again from its position, in order, as Kafka would: what was handed out
        from there and what was not yet, and nothing below it (not handed out yet, it is skipped)."""
        self.seeks.append(dict(positions))
        moved = {(r.topic, r.partition, r.offset): r for r in [*self.delivered, *self.records]
                 if (r.topic, r.partition) in positions and r.offset >= positions[(r.topic, r.partition)]}
        self.records = [r for r in self.records if (r.topic, r.partition) not in positions]
        self.records = [moved[key] for key in sorted(moved)] + self.records

    def revoke(self, parts: list[tuple[str, int]]) -> None:
        """Revoke ``parts`` at the next poll, as a rebalance would."""
        self.revoking += parts

    async def poll(self, max_records: int, timeout: float) -> Batch:
        await asyncio.sleep(0.005)
        batch = Batch()
        batch.revoked, self.revoking = self.revoking, []
        if not self.assigned_once and self.subscriptions:
            batch.assigned = sorted({(r.topic, r.partition) for r in self.records})
            self.assigned_once = True
        if not self.subscriptions:
            return batch
        take = [r for r in self.records if (r.topic, r.partition) not in self.paused][:self.batch_size]
        for record in take:
            self.records.remove(record)
        self.delivered += take
        batch.records = take
        return batch

    async def pause(self, parts) -> None:
        self.pauses += bool(parts)
        self.paused.update(parts)

    async def resume(self, parts) -> None:
        self.paused.difference_update(parts)

    async def commit(self, positions) -> bool:
        self.commits.append(dict(positions))
        return True

    def offer_positions(self, positions) -> None:
        self.offered = dict(positions)

    def committed(self) -> dict[tuple[str, int], int]:
        merged: dict[tuple[str, int], int] = {}
        for positions in self.commits:
            merged.update(positions)
        return merged


def image_bytes(fmt: str = "JPEG", size=(64, 48), mode: str = "RGB", color: Any = (200, 30, 30),
                **save: Any) -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, color).save(out, fmt, **save)
    return out.getvalue()


def png_bomb(width: int = 30_000, height: int = 30_000) -> bytes:
    """A valid 1-bit PNG of width x height zeros: ~110 KB on disk, 900 megapixels decoded."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    row = b"\x00" * (1 + (width + 7) // 8)
    compressor = zlib.compressobj(9)
    idat = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def exif_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x13B] = "Alden Page"
    exif[0x10F] = "Canon\x00\x00"                                      # NUL padding
    exif[0x11A] = TiffImagePlugin.IFDRational(72, 1)
    exif[0x8769] = {
        0x9209: 0,                                                      # Flash
        0x829A: TiffImagePlugin.IFDRational(1, 0),                      # zero denominator: NaN
        0x927C: b"\xff\xfe\x00\x81binary",                              # maker note: not UTF-8
        0x9286: b"ASCII\x00\x00\x00hello",                              # user comment
        0x829D: TiffImagePlugin.IFDRational(28, 10),                    # FNumber
    }
    exif[0x8825] = {1: "N", 2: (TiffImagePlugin.IFDRational(40, 1), TiffImagePlugin.IFDRational(30, 1),
                                TiffImagePlugin.IFDRational(15, 2))}
    return image_bytes("JPEG", (16, 16), exif=exif)


class LoopbackResolver(AbstractResolver):
    """Connects every hostname to 127.0.0.1, so a 'public' test host needs no network (and a
    name that rebinds to loopback can be played)."""

    async def resolve(self, host, port=0, family=socket.AF_INET):
        return [{"hostname": host, "host": "127.0.0.1", "port": port, "family": socket.AF_INET,
                 "proto": 0, "flags": socket.AI_NUMERICHOST}]

    async def close(self):
        pass


def kill_and_wait(pid: int) -> None:
    """SIGKILL ``pid``, as the OOM killer would, and wait until it has died; its parent still reaps it."""
    fd = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGKILL)
        select.select([fd], [], [])
    finally:
        os.close(fd)


def process_gone(pid: int) -> bool:
    """No process ``pid`` any more, not even one dead and waiting to be reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
