"""The pool's turns: arrival less head start, cancelled waiters skipped, a handed turn never lost."""
from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager

import pytest

from worker.imaging.turns import HEAD_START, Turns, head_start


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def order_of(arrivals: list[tuple[str, float, float]], size: int = 1) -> list[str]:
    """Hold every turn, let ``(name, arrives_at, head_start)`` queue up, give the turns back one by
    one: the order in which the waiters got theirs."""
    clock, taken = Clock(), []
    turns = Turns(size, clock)
    holders = [turns.turn() for _ in range(size)]
    for holder in holders:
        await holder.__aenter__()

    async def wait(name: str, seconds: float) -> None:
        async with turns.turn(seconds):
            taken.append(name)

    waiters = []
    for name, at, seconds in arrivals:
        clock.now = 100.0 + at
        waiters.append(asyncio.create_task(wait(name, seconds)))
        await asyncio.sleep(0)  # queued now, at this time
    assert turns.waiting == len(arrivals)
    for holder in holders:
        await holder.__aexit__(None, None, None)
    await asyncio.gather(*waiters)
    return taken


@pytest.mark.parametrize("arrivals, order", [
    ([("a", 0, 0), ("b", 1, 0), ("c", 2, 0)], "abc"),            # no head start: arrival order
    ([("one", 0, 0), ("big", 1, 4.0)], ["big", "one"]),          # a backlog's image first...
    ([("one", 0, 0), ("big", 5, 4.0)], ["one", "big"]),          # ... not past one more than its head start earlier
    ([("a", 0, 2.0), ("b", 1, 2.0)], "ab"),                      # equal head starts: arrival order
    ([("a", 0, 0), ("b", 0, 0)], "ab"),                          # same instant: arrival order
    ([("a", 0, 0), ("neg", 1, -5.0)], ["a", "neg"]),             # no head start below 0
])
async def test_waiters_are_let_in_by_arrival_less_head_start(arrivals, order) -> None:
    assert await order_of(arrivals) == list(order)


async def test_free_turns_are_taken_at_once_and_at_most_size_held() -> None:
    turns, inside, most = Turns(3), 0, 0

    async def hold() -> None:
        nonlocal inside, most
        async with turns.turn():
            inside += 1
            most = max(most, inside)
            await asyncio.sleep(0.01)
            inside -= 1

    await asyncio.gather(*(hold() for _ in range(10)))
    assert most == 3
    async with asyncio.timeout(1):  # all three free again
        async with turns.turn(), turns.turn(), turns.turn():
            pass


async def one_turn_held_and_two_waiting() -> tuple[Turns, AbstractAsyncContextManager[None], list[str],
                                                  asyncio.Task[None], asyncio.Task[None]]:
    """One turn, held by ``holder``; "first" and "second" queued behind it, each noting in ``got``
    when it has the turn."""
    turns = Turns(1)
    holder = turns.turn()
    await holder.__aenter__()
    got: list[str] = []

    async def wait(name: str) -> None:
        async with turns.turn():
            got.append(name)

    first, second = asyncio.create_task(wait("first")), asyncio.create_task(wait("second"))
    await asyncio.sleep(0)
    return turns, holder, got, first, second


async def test_a_cancelled_waiter_is_skipped_and_its_turn_goes_to_the_next() -> None:
    turns, holder, got, first, second = await one_turn_held_and_two_waiting()
    first.cancel()
    await asyncio.sleep(0)
    await holder.__aexit__(None, None, None)
    await second
    assert got == ["second"] and turns.waiting == 0


async def test_a_waiter_cancelled_after_it_was_handed_the_turn_hands_it_on() -> None:
    turns, holder, got, first, second = await one_turn_held_and_two_waiting()
    await holder.__aexit__(None, None, None)  # hands the turn to first, which has not run yet...
    first.cancel()                            # ... and is cancelled before it does
    await asyncio.gather(first, return_exceptions=True)
    async with asyncio.timeout(1):
        await second
    assert got == ["second"]
    async with asyncio.timeout(1):  # and the one turn is free again
        async with turns.turn():
            pass


async def test_the_head_start_is_the_running_tasks_own() -> None:
    assert head_start() == 0.0  # outside a scheduled task

    async def task(seconds: float) -> float:
        HEAD_START.set(lambda: seconds)
        await asyncio.sleep(0)
        return head_start()

    assert await asyncio.gather(task(1.5), task(0.0), task(7.0)) == [1.5, 0.0, 7.0]
    assert head_start() == 0.0
