"""Each partition's finished offsets above its commit, kept in Redis for its next owner.

Kafka commits one position a partition: the lowest offset not finished. Everything a
worker finished above it (its parks, the crawls that overtook a slow one) was read and
done again by whoever owned the partition next, after a SIGKILL, a rebalance or a broker
restart (docs/decisions.md, "Fleet scale"). Commit metadata could
hold them on Apache Kafka, but the local broker drops it, so they are kept here instead:
a sorted set per partition (``finished_offsets:{topic}:{partition}``, member and score the
offset), added to in batches as outcomes are acknowledged, trimmed below each commit, and
read by the next owner before it takes the partition's records. Its size follows the
window between a partition's commit and its newest finished offset, and it expires
FINISHED_OFFSETS_TTL after its last write.

Every write is a fact (an acknowledged offset, or a commit accepted), whoever makes it,
so a revoked owner's late write does no harm; what was finished in the last flush interval
before a crash is lost from the record and done again, as what was in flight is.
"""
from __future__ import annotations

from collections.abc import Iterable

from common.contracts import EVENT_FINISHED_RECORD_FAILED, finished_offsets_key
from common.jsonlog import log_event
from common.protocols import AsyncRedis
from worker.constants import FINISHED_OFFSETS_BUFFER, FINISHED_OFFSETS_TTL
from worker.intake.feed import TP, Record
from worker.intake.offsets import PartitionOffsets


class FinishedRecord:
    def __init__(self, redis: AsyncRedis, ttl: int = FINISHED_OFFSETS_TTL):
        self._redis = redis
        self._ttl = ttl
        self._new: dict[TP, list[int]] = {}  # finished since the last flush
        self._trim: dict[TP, int] = {}       # positions committed since the last flush
        self._buffered = 0

    def finished(self, tp: TP, offset: int) -> None:
        """``offset`` of ``tp`` is done (its outcome or park acknowledged): written at the next flush."""
        if self._buffered >= FINISHED_OFFSETS_BUFFER:  # Redis away for long: at-least-once still holds
            return
        self._new.setdefault(tp, []).append(offset)
        self._buffered += 1

    def committed(self, positions: dict[TP, int]) -> None:
        """Positions the broker accepted: below them the record is no longer needed."""
        for tp, position in positions.items():
            self._trim[tp] = max(position, self._trim.get(tp, position))

    @property
    def pending(self) -> bool:
        return bool(self._new or self._trim)

    async def flush(self) -> None:
        """One pipeline: each partition's new offsets (its expiry renewed), then its trim."""
        if not self.pending:
            return
        new, trim = self._new, self._trim
        self._new, self._trim, self._buffered = {}, {}, 0
        pipe = self._redis.pipeline(transaction=False)
        for tp in new.keys() | trim.keys():
            key = finished_offsets_key(*tp)
            if tp in new:
                pipe.zadd(key, {str(offset): offset for offset in new[tp]})
                pipe.expire(key, self._ttl)
            if tp in trim:
                pipe.zremrangebyscore(key, "-inf", trim[tp] - 1)
        try:
            await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - Redis away: kept for the next flush (bounded)
            log_event(EVENT_FINISHED_RECORD_FAILED, error=repr(exc)[:300], partitions=len(new.keys() | trim.keys()))
            for tp, offsets in new.items():
                for offset in offsets:
                    self.finished(tp, offset)
            self.committed({tp: position for tp, position in trim.items()})

    async def load(self, parts: Iterable[TP]) -> dict[TP, set[int]]:
        """The finished offsets recorded for ``parts`` (a partition with none is left out); an
        empty answer if Redis does not answer (those offsets are done again: at-least-once)."""
        parts = sorted(parts)
        if not parts:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for tp in parts:
            pipe.zrange(finished_offsets_key(*tp), 0, -1)
        try:
            answers = await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - Redis away
            log_event(EVENT_FINISHED_RECORD_FAILED, error=repr(exc)[:300], partitions=len(parts), at="load")
            return {}
        loaded: dict[TP, set[int]] = {}
        for tp, members in zip(parts, answers, strict=True):
            offsets = {int(m) for m in members or () if str(m).isdigit()}
            if offsets:
                loaded[tp] = offsets
        return loaded


class Skips:
    """The offsets a new owner skips: finished by a previous owner above the commit."""

    def __init__(self) -> None:
        self._by_part: dict[TP, set[int]] = {}

    def add(self, loaded: dict[TP, set[int]]) -> None:
        self._by_part.update(loaded)

    def forget(self, parts: Iterable[TP]) -> None:
        for tp in parts:
            self._by_part.pop(tp, None)

    def first_read(self, tp: TP, offset: int) -> None:
        """The partition's first record read here: nothing below it will come (the commit)."""
        skips = self._by_part.get(tp)
        if skips:
            kept = {o for o in skips if o >= offset}
            if kept:
                self._by_part[tp] = kept
            else:
                del self._by_part[tp]

    def take(self, tp: TP, offset: int) -> bool:
        """True if ``offset`` was finished already (and is skipped): forgotten once taken."""
        skips = self._by_part.get(tp)
        if not skips or offset not in skips:
            return False
        skips.discard(offset)
        if not skips:
            del self._by_part[tp]
        return True

    def __len__(self) -> int:
        return sum(len(s) for s in self._by_part.values())


def take_new(record: Record, offsets: dict[TP, PartitionOffsets], skips: Skips) -> bool:
    """True if ``record`` is new work here; False if it is in progress already (read again) or
    a previous owner finished it (then it is finished here at once)."""
    tp = (record.topic, record.partition)
    partition = offsets.get(tp)
    if partition is None:
        partition = offsets[tp] = PartitionOffsets()
        skips.first_read(tp, record.offset)
    if record.offset in partition:
        return False
    partition.add(record.offset)
    if skips.take(tp, record.offset):
        partition.finish(record.offset)
        return False
    return True
