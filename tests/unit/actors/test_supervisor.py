"""Actors restart one for one with backoff; past the budget the supervisor escalates."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from sluice.actors.runtime.base import Actor
from sluice.actors.runtime.supervisor import Escalation, RestartPolicy, Supervisor


class Boom(Exception):
    pass


class Counter(Actor):
    """Counts `int` messages; a negative one crashes it."""

    def __init__(self, name: str):
        super().__init__(name)
        self.starts = 0
        self.crash_cleanups: list[int] = []
        self.seen: list[int] = []

    def reset(self) -> None:
        self.starts += 1
        self.total = 0

    def handlers(self):
        return {int: self.on_int}

    async def on_int(self, value: int) -> None:
        if value < 0:
            raise Boom(value)
        self.total += value
        self.seen.append(value)

    async def on_crash(self, exc: BaseException) -> None:
        self.crash_cleanups.append(self.total)


async def test_crashed_actor_restarts_alone_with_fresh_state(autojump_clock) -> None:
    a, b = Counter("a"), Counter("b")
    sup = Supervisor(RestartPolicy(max_restarts=3, window=10, backoff_initial=1))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run, [a, b])
        a.inbox.put(5)
        b.inbox.put(7)
        a.inbox.put(-1)
        a.inbox.put(2)  # queued behind the crash; the restarted actor handles it
        await trio.sleep(5)
        assert a.crash_cleanups == [5]  # cleanup saw the state the crash left
        assert (a.starts, a.total, a.seen) == (2, 2, [5, 2])
        assert (b.starts, b.total) == (1, 7)
        assert sup.restarts == {"a": 1}
        nursery.cancel_scope.cancel()


async def test_backoff_doubles_between_restarts(autojump_clock) -> None:
    a = Counter("a")
    sup = Supervisor(RestartPolicy(max_restarts=10, window=100, backoff_initial=1, backoff_max=3))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run, [a])
        start = trio.current_time()
        restart_times = []
        for _ in range(4):
            before = a.starts
            a.inbox.put(-1)
            while a.starts == before:
                await trio.sleep(0.01)
            restart_times.append(round(trio.current_time() - start))
        assert restart_times == [1, 3, 6, 9]  # 1, 2, 3 (capped), 3
        nursery.cancel_scope.cancel()


async def test_escalates_past_the_restart_budget(autojump_clock) -> None:
    a = Counter("a")
    sup = Supervisor(RestartPolicy(max_restarts=2, window=60, backoff_initial=0.1))
    with pytest.RaisesGroup(Escalation, flatten_subgroups=True):
        async with trio.open_nursery() as nursery:
            await nursery.start(sup.run, [a])
            for _ in range(3):
                before = a.crash_cleanups[:]
                a.inbox.put(-1)
                while a.crash_cleanups == before:
                    await trio.sleep(0.01)
            await trio.sleep(5)
    assert a.starts == 3


async def test_crashes_spread_over_time_stay_within_budget(autojump_clock) -> None:
    a = Counter("a")
    sup = Supervisor(RestartPolicy(max_restarts=1, window=10, backoff_initial=0.1))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run, [a])
        for _ in range(4):
            a.inbox.put(-1)
            await trio.sleep(20)  # older crashes leave the window
        assert a.starts == 5
        nursery.cancel_scope.cancel()


async def test_dynamic_child_can_be_stopped(autojump_clock) -> None:
    sup = Supervisor()
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run, [])
        c = Counter("c")
        await sup.start_child(c)
        assert c.running
        sup.stop_child(c)
        await trio.sleep(1)
        assert not c.running
        nursery.cancel_scope.cancel()
