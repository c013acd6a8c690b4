"""Small in-process fakes of Redis and Kafka for the monitor's unit tests (plus their own checks).

Only the calls the monitor makes are implemented, with Redis's
``decode_responses=True`` semantics: every value comes back as ``str``.
"""
from __future__ import annotations

import math
from typing import Any


def _bound(raw: Any) -> tuple[float, bool]:
    """A ZRANGEBYSCORE bound: (value, exclusive)."""
    text = str(raw)
    exclusive = text.startswith("(")
    text = text.lstrip("(")
    value = {"-inf": -math.inf, "+inf": math.inf, "inf": math.inf}.get(text)
    return (float(text) if value is None else value), exclusive


def _in_range(score: float, low: Any, high: Any) -> bool:
    return _range(low, high)(score)


def _range(low: Any, high: Any):
    """A test of a score against two bounds, parsed once (100,000 members are tested)."""
    (lo, lo_ex), (hi, hi_ex) = _bound(low), _bound(high)
    return lambda score: (score > lo if lo_ex else score >= lo) and (score < hi if hi_ex else score <= hi)


class FakeStore:
    """The data and the commands, synchronous."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.expiry: dict[str, float] = {}
        self.closed = False

    def get(self, key: str) -> str | None:
        return self.data.get(key)

    def set(self, key: str, value: Any, ex: int | None = None, px: int | None = None) -> bool:
        """Records the expiry in seconds."""
        self.data[key] = str(value)
        if ex is None and px is None:
            self.expiry.pop(key, None)
        else:
            self.expiry[key] = ex if ex is not None else px / 1000
        return True

    def mget(self, keys: list[str]) -> list[str | None]:
        return [self.data.get(key) for key in keys]

    def delete(self, *keys: str) -> int:
        return sum(self.data.pop(key, None) is not None for key in keys)

    def incrby(self, key: str, amount: int) -> int:
        self.data[key] = str(int(self.data.get(key, 0)) + amount)
        return int(self.data[key])

    def decr(self, key: str) -> int:
        return self.incrby(key, -1)

    def smembers(self, key: str) -> set[str]:
        return set(self.data.get(key, set()))

    def sadd(self, key: str, *members: str) -> int:
        current = self.data.setdefault(key, set())
        added = len(set(members) - current)
        current.update(members)
        return added

    def smismember(self, key: str, members: list[str]) -> list[int]:
        current = self.data.get(key, set())
        return [int(member in current) for member in members]

    def scard(self, key: str) -> int:
        return len(self.data.get(key, set()))

    def srem(self, key: str, *members: str) -> int:
        current = self.data.get(key, set())
        removed = len(current & set(members))
        current.difference_update(members)
        return removed

    def rpush(self, key: str, *values: str) -> int:
        self.data.setdefault(key, []).extend(str(v) for v in values)
        return len(self.data[key])

    def lrange(self, key: str, start: int, end: int) -> list[str]:
        values = self.data.get(key, [])
        start = max(0, len(values) + start) if start < 0 else start
        end = len(values) if end == -1 else (len(values) + end + 1 if end < 0 else end + 1)
        return list(values[start:end])

    def hincrby(self, key: str, field: str, amount: int) -> int:
        counts = self.data.setdefault(key, {})
        counts[field] = counts.get(field, 0) + amount
        return counts[field]

    def hmget(self, key: str, fields: list[str]) -> list[str | None]:
        stored = self.data.get(key, {})
        return [None if stored.get(field) is None else str(stored[field]) for field in fields]

    def hgetall(self, key: str) -> dict[str, str]:
        return {field: str(value) for field, value in self.data.get(key, {}).items()}

    def hset(self, key: str, mapping: dict[str, Any]) -> int:
        fields = self.data.setdefault(key, {})
        added = len(set(mapping) - set(fields))
        fields.update({name: str(value) for name, value in mapping.items()})
        return added

    def expire(self, key: str, seconds: int) -> bool:
        if key not in self.data:
            return False
        self.expiry[key] = seconds
        return True

    def hkeys(self, key: str) -> list[str]:
        return list(self.data.get(key, {}))

    def hdel(self, key: str, *fields: str) -> int:
        counts = self.data.get(key, {})
        return sum(counts.pop(field, None) is not None for field in fields)

    def zadd(self, key: str, mapping: dict[str, float], gt: bool = False) -> int:
        zset = self.data.setdefault(key, {})
        if gt:
            mapping = {m: s for m, s in mapping.items() if s > zset.get(m, float("-inf"))}
        added = sum(1 for member in mapping if member not in zset)
        zset.update(mapping)
        return added

    def zrangebyscore(self, key: str, low: Any, high: Any, withscores: bool = False) -> list:
        zset = self.data.get(key, {})
        within = _range(low, high)
        members = sorted(((m, s) for m, s in zset.items() if within(s)), key=lambda kv: kv[1])
        return members if withscores else [m for m, _s in members]

    def zremrangebyscore(self, key: str, low: Any, high: Any) -> int:
        zset = self.data.get(key, {})
        within = _range(low, high)
        gone = [m for m, s in zset.items() if within(s)]
        for member in gone:
            del zset[member]
        return len(gone)

    def close(self) -> None:
        self.closed = True


class RecordingStore(FakeStore):
    """A FakeStore that records every command: its name, its arguments and its reply, so a test
    can say what one second of the monitor read and wrote (issue 26: 100,000 sources)."""

    def __init__(self) -> None:
        super().__init__()
        self.commands: list[tuple[str, tuple, Any]] = []

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if name.startswith("_") or name in ("commands", "data", "expiry", "closed", "names", "items_read") \
                or not callable(attr):
            return attr

        def recorded(*args: Any, **kwargs: Any) -> Any:
            reply = attr(*args, **kwargs)
            super(RecordingStore, self).__getattribute__("commands").append((name, args, reply))
            return reply
        return recorded

    def names(self) -> set[str]:
        """Every key and member the commands were given."""
        found: set[str] = set()
        for _name, args, _reply in self.commands:
            for arg in args:
                values = arg if isinstance(arg, (list, tuple, set)) else list(arg) if isinstance(arg, dict) else [arg]
                found.update(str(value) for value in values)
        return found

    def items_read(self) -> int:
        """Values, members and fields the replies held (a missing key counts one)."""
        return sum(len(reply) if isinstance(reply, (list, set, dict)) else 1 for _n, _a, reply in self.commands)


class _Pipeline:
    def __init__(self, store: FakeStore):
        self._store = store
        self._calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str):
        def queue(*args: Any, **kwargs: Any) -> _Pipeline:
            self._calls.append((name, args, kwargs))
            return self
        return queue

    def _run(self) -> list[Any]:
        calls, self._calls = self._calls, []
        return [getattr(self._store, name)(*args, **kwargs) for name, args, kwargs in calls]


class SyncPipeline(_Pipeline):
    def __enter__(self) -> SyncPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def execute(self) -> list[Any]:
        return self._run()


class AsyncPipeline(_Pipeline):
    async def __aenter__(self) -> AsyncPipeline:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def execute(self) -> list[Any]:
        return self._run()


class FakeRedis(FakeStore):
    """redis.Redis (sync): commands and ``pipeline()``."""

    fail_next = 0  # make this many pipeline executions or script calls raise ConnectionError

    def register_script(self, script: str):
        """The splitter's RECORD_SPLIT, run in Python on the same keys."""
        from crawl_monitor.splitter import RECORD_SPLIT
        assert script == RECORD_SPLIT, "FakeRedis knows only the splitter's script"

        def record_split(keys: list[str], args: list) -> int:
            if self.fail_next:
                self.fail_next -= 1
                raise ConnectionError("fake Redis is down")
            counted = keys[3:]
            sources = args[2:len(args) - len(counted)]
            self.incrby(keys[1], int(args[0]))
            self.sadd(keys[0], *sources)
            self.zadd(keys[2], dict.fromkeys(sources, float(args[1])), gt=True)
            for key, count in zip(counted, args[len(args) - len(counted):], strict=True):
                self.incrby(key, int(count))
            return len(counted)
        return record_split

    def pipeline(self, transaction: bool = True) -> SyncPipeline:
        store = self

        class Failing(SyncPipeline):
            def execute(self) -> list[Any]:
                if store.fail_next:
                    store.fail_next -= 1
                    raise ConnectionError("fake Redis is down")
                return super().execute()

        return Failing(self)


class FakeAsyncRedis:
    """redis.asyncio.Redis: the same store behind awaitable commands."""

    def __init__(self, store: FakeStore | None = None):
        self.store = store or FakeStore()

    def pipeline(self, transaction: bool = True) -> AsyncPipeline:
        return AsyncPipeline(self.store)

    def register_script(self, script: str):
        """The monitor's scripts (regulator.REFILL, batched_keys'), run in Python on the same keys,
        through the store's commands (a RecordingStore records them)."""
        from common import contracts
        from crawl_monitor import batched_keys
        from crawl_monitor.active_sources import SCORED_SINCE
        from crawl_monitor.circuit_breaker import READ_WINDOWS
        from crawl_monitor.regulator import REFILL
        store = self.store

        async def refill(keys: list[str], args: list) -> int:
            n = int(args[2])
            for i, key in enumerate(keys):
                if i < n:
                    store.set(key, args[3 + i], px=int(args[0]))
                else:
                    store.set(key, args[3 + i], ex=int(args[1]))
            return n

        async def hgetall_many(keys: list[str], args: list) -> list[list[str]]:
            return [[item for pair in store.hgetall(key).items() for item in pair] for key in keys]

        async def lrange_many(keys: list[str], args: list) -> list[list[str]]:
            return [store.lrange(key, int(args[0]), int(args[1])) for key in keys]

        async def smembers_many(keys: list[str], args: list) -> list[list[str]]:
            return [sorted(store.smembers(key)) for key in keys]

        async def hset_expire_many(keys: list[str], args: list) -> int:
            at = 1
            for key in keys:
                n = int(args[at])
                fields = args[at + 1:at + 1 + 2 * n]
                mapping = dict(zip(fields[::2], fields[1::2], strict=True))
                store.hset(key, mapping=mapping)
                for field, value in mapping.items():
                    if value == "":
                        store.hdel(key, field)
                store.expire(key, int(args[0]))
                at += 1 + 2 * n
            return len(keys)

        async def hdel_buckets_up_to(keys: list[str], args: list) -> int:
            dropped = 0
            for key, cutoff in zip(keys, args, strict=True):
                old = [f for f in store.hgetall(key) if contracts.bucket_of_field(f) <= float(cutoff)]
                if old:
                    dropped += store.hdel(key, *old)
            return dropped

        async def scored_since(keys: list[str], args: list) -> list:
            pairs = store.zrangebyscore(keys[0], args[0], "+inf", withscores=True)
            if len(args) > 1:  # the latest, at most this many
                pairs = sorted(pairs, key=lambda pair: -pair[1])[:int(args[1])]
            return [item for pair in pairs for item in (pair[0], repr(float(pair[1])))]

        async def read_windows(keys: list[str], args: list) -> list[list[str]]:
            replies = []
            for minute, last_50 in zip(keys[::2], keys[1::2], strict=True):
                store.zremrangebyscore(minute, "-inf", args[0])
                replies += [store.zrangebyscore(minute, args[1], "+inf"), store.lrange(last_50, -int(args[2]), -1)]
            return replies

        scripts = {REFILL: refill, READ_WINDOWS: read_windows, batched_keys.HGETALL_MANY: hgetall_many,
                   batched_keys.LRANGE_MANY: lrange_many, batched_keys.SMEMBERS_MANY: smembers_many,
                   batched_keys.HSET_EXPIRE_MANY: hset_expire_many,
                   batched_keys.HDEL_BUCKETS_UP_TO: hdel_buckets_up_to, SCORED_SINCE: scored_since}
        assert script in scripts, "FakeAsyncRedis knows only the monitor's scripts"
        return scripts[script]

    def __getattr__(self, name: str):
        command = getattr(self.store, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return command(*args, **kwargs)
        return call


# --- Kafka ---------------------------------------------------------------
class FakeMessage:
    def __init__(self, value: bytes | None, offset: int, topic: str = "inbound", partition: int = 0,
                 error: Any = None, key: Any = None):
        self._value, self._offset, self._topic, self._partition, self._error, self._key = (
            value, offset, topic, partition, error, key)

    def value(self) -> bytes | None:
        return self._value

    def key(self) -> Any:
        return self._key

    def offset(self) -> int:
        return self._offset

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def error(self) -> Any:
        return self._error


class FakeConsumer:
    """Hands out queued batches; records commits."""

    def __init__(self, batches: list[list[FakeMessage]]):
        self.batches = list(batches)
        self.commits: list[list[tuple[str, int, int]]] = []
        self.closed = False

    def consume(self, num_messages: int, timeout: float) -> list[FakeMessage]:
        return self.batches.pop(0) if self.batches else []

    def commit(self, offsets: list, asynchronous: bool) -> None:
        assert asynchronous is False
        self.commits.append([(tp.topic, tp.partition, tp.offset) for tp in offsets])

    def close(self) -> None:
        self.closed = True


class FakeProducer:
    """Acknowledges on flush; the first ``fail_first`` messages of a flush fail once each."""

    def __init__(self, fail_first: int = 0, buffer_errors: int = 0, failed_offset: int | None = -1):
        self.failed_offset = failed_offset  # None: as librdkafka reports a message that timed out queued
        self.delivered: list[tuple[str, Any, bytes]] = []
        self.queued: list[tuple[str, Any, bytes, Any, int | None]] = []
        self.placed: list[int | None] = []  # the partition asked for, per delivered message
        self.fail_first = fail_first
        self.buffer_errors = buffer_errors

    def produce(self, topic: str, value: bytes, key: Any = None, on_delivery: Any = None,
                partition: int | None = None) -> None:
        if self.buffer_errors:
            self.buffer_errors -= 1
            raise BufferError("queue full")
        self.queued.append((topic, key, value, on_delivery, partition))

    def poll(self, timeout: float = 0) -> int:
        return 0

    def flush(self, timeout: float = 0) -> int:
        queued, self.queued = self.queued, []
        for topic, key, value, on_delivery, partition in queued:
            if self.fail_first:
                self.fail_first -= 1
                on_delivery("broker said no", FakeMessage(value, self.failed_offset, topic,  # type: ignore[arg-type]
                                                          key=key, partition=partition or 0))
            else:
                self.delivered.append((topic, key, value))
                self.placed.append(partition)
        return 0


# --- The fakes' own checks ------------------------------------------------
def test_fake_store_follows_redis_semantics() -> None:
    store = FakeStore()
    store.zadd("z", {"a:1": 1.0, "b:2": 2.0, "c:3": 3.0})
    assert store.zrangebyscore("z", 2.0, "+inf") == ["b:2", "c:3"]
    assert store.zremrangebyscore("z", "-inf", "(2.0") == 1
    assert store.zrangebyscore("z", "-inf", "+inf") == ["b:2", "c:3"]
    store.rpush("l", *"abc")
    assert store.lrange("l", 0, -1) == ["a", "b", "c"] and store.lrange("l", 0, 1) == ["a", "b"]
    assert store.lrange("l", -2, -1) == ["b", "c"] and store.lrange("l", -50, -1) == ["a", "b", "c"]
    assert store.decr("missing") == -1
    assert store.sadd("s", "x", "y") == 2 and store.sadd("s", "x") == 0 and store.srem("s", "x") == 1
