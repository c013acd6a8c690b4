"""Which offset of a partition is safe to commit when tasks finish out of order.

A message's offset may be committed only once its outcome is acknowledged
(SPEC.md §1: at-least-once), and Kafka commits a single position per
partition: everything below it counts as done. So the position is the
lowest offset still unfinished, or one past the highest seen when none is.
"""
from __future__ import annotations

import heapq
from collections.abc import Awaitable, Callable

from worker.intake.feed import TP


class PartitionOffsets:
    def __init__(self) -> None:
        self._unfinished: set[int] = set()
        self._lowest: list[int] = []  # a heap of unfinished offsets; finished ones leave it at its top
        self._next: int | None = None      # one past the highest offset seen
        self.committed: int | None = None  # the last position committed
        self.held_back: int | None = None  # the lowest offset left in Kafka to be read again (read_ahead)

    def __contains__(self, offset: int) -> bool:
        return offset in self._unfinished

    def seen(self, offset: int) -> bool:
        """Read before: below the highest offset read here."""
        return self._next is not None and offset < self._next

    def passed(self, offset: int) -> None:
        """Read and not taken (left in Kafka, or finished by a previous owner): nothing to finish."""
        if self.committed is None:
            self.committed = offset
        self._next = offset + 1 if self._next is None else max(self._next, offset + 1)

    def add(self, offset: int) -> None:
        if self.committed is None:
            self.committed = offset  # where the group's position already is: nothing to commit yet
        if offset not in self._unfinished:
            self._unfinished.add(offset)
            heapq.heappush(self._lowest, offset)
        self._next = offset + 1 if self._next is None else max(self._next, offset + 1)

    def finish(self, offset: int) -> None:
        self._unfinished.discard(offset)

    def committable(self) -> int | None:
        """The position to commit, or None when nothing new is safe to commit."""
        if len(self._lowest) > 2 * len(self._unfinished) + 1024:  # finished ones held by a slow lowest
            self._lowest = list(self._unfinished)
            heapq.heapify(self._lowest)
        while self._lowest and self._lowest[0] not in self._unfinished:
            heapq.heappop(self._lowest)
        position = self._lowest[0] if self._lowest else self._next
        if position is not None and self.held_back is not None:
            position = min(position, self.held_back)
        if position is None or (self.committed is not None and position <= self.committed):
            return None
        return position


def committable_positions(partitions: dict[TP, PartitionOffsets]) -> dict[TP, int]:
    """Each partition's lowest unfinished offset, where that moved past its last commit."""
    return {tp: position for tp, offsets in partitions.items() if (position := offsets.committable()) is not None}


async def commit_finished(commit: Callable[[dict[TP, int]], Awaitable[bool]],
                          partitions: dict[TP, PartitionOffsets]) -> dict[TP, int]:
    """Commit each partition up to its lowest unfinished offset, where that moved; remember
    what the broker accepted (a refused commit is retried with the next) and return it."""
    positions = committable_positions(partitions)
    if positions and await commit(positions):
        for tp, position in positions.items():
            partitions[tp].committed = position
        return positions
    return {}
