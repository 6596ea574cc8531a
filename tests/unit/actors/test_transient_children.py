"""Transient children (a client connection's Stream) are the client's: their crashes never
escalate, and nothing of them stays in the supervisor once they end."""

from __future__ import annotations

import trio
import trio.testing

from sluice.actors.runtime.base import Actor
from sluice.actors.runtime.supervisor import RestartPolicy, Supervisor


class Fragile(Actor):
    """Crashes on every message; counts its starts."""

    def __init__(self, name: str):
        super().__init__(name)
        self.starts = 0
        self.cleanups = 0

    def reset(self) -> None:
        self.starts += 1

    def handlers(self):
        return {int: self.on_int}

    async def on_int(self, value: int) -> None:
        if value < 0:
            raise RuntimeError("injected")

    async def on_crash(self, exc: BaseException) -> None:
        self.cleanups += 1


async def test_a_transient_child_that_keeps_crashing_is_closed_not_escalated(
        autojump_clock) -> None:
    sup = Supervisor(RestartPolicy(max_restarts=2, window=60, backoff_initial=0.1))
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run, [])
        children = [Fragile(f"stream-{i}") for i in range(20)]
        for child in children:
            await sup.start_child(child, transient=True)
            for _ in range(5):  # more crashes than the budget that escalates a daemon actor
                child.inbox.put(-1)
        await trio.sleep(30)
        for child in children:
            assert child.cleanups == 3  # each crash let it clean up, up to the budget
            assert child.starts == 3
            assert not child.running
        assert sup.restarts == {}
        assert sup._scopes == {}  # no bookkeeping left for ended children
        nursery.cancel_scope.cancel()


async def test_a_transient_child_that_returns_leaves_nothing_behind(autojump_clock) -> None:
    sup = Supervisor()
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run, [])
        child = Fragile("stream-x")
        await sup.start_child(child, transient=True)
        child.inbox.put(-1)  # one crash: restarted, not counted
        await trio.sleep(1)
        assert child.running and child.starts == 2
        child.close()  # what a closed stream does once the gateway forgot it
        await trio.sleep(1)
        assert not child.running
        assert sup.restarts == {} and sup._scopes == {}
        nursery.cancel_scope.cancel()
