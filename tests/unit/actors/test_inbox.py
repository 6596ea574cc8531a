"""Inboxes are ZeroMQ inproc sockets: messages arrive in order as copies, a closed inbox ends
its actor cleanly and swallows late messages, and a daemon can hold thousands of them."""

from __future__ import annotations

import trio
import trio.testing

from sluice.actors.runtime import messages as am
from sluice.actors.runtime.base import Actor, Inbox, Outbox
from sluice.actors.runtime.supervisor import Supervisor
from sluice.ipc import messages as m


class Recorder(Actor):
    def __init__(self) -> None:
        super().__init__("recorder")
        self.seen: list = []
        self.starts = 0

    def reset(self) -> None:
        self.starts += 1

    def handlers(self):
        return {am.PauseDecoding: self.on_pause, int: self.on_int}

    async def on_pause(self, msg: am.PauseDecoding) -> None:
        self.seen.append(msg)

    async def on_int(self, value: int) -> None:
        self.seen.append(value)


async def test_messages_cross_an_inproc_socket_in_order() -> None:
    actor = Recorder()
    assert actor.inbox.address.startswith("inproc://")
    sender = Outbox(actor.inbox.address)  # another actor's handle, by address only
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        for i in range(300):
            sender.put(am.PauseDecoding(f"r{i}") if i % 2 else i)
        with trio.fail_after(5):
            while len(actor.seen) < 300:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert actor.seen == [am.PauseDecoding(f"r{i}") if i % 2 else i for i in range(300)]
    sender.close()
    actor.close()


async def test_depth_counts_messages_not_yet_taken() -> None:
    inbox = Inbox("depth")
    for i in range(5):
        inbox.put(i)
    assert inbox.depth == 5
    assert [inbox.get_nowait() for _ in range(2)] == [0, 1]
    assert inbox.depth == 3
    inbox.close()


async def test_a_closed_inbox_ends_its_actor_and_drops_late_messages() -> None:
    actor = Recorder()
    other = Outbox(actor.inbox.address)
    supervisor = Supervisor()
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run, [actor])
        other.put(1)
        with trio.fail_after(5):
            while actor.seen != [1]:
                await trio.sleep(0.01)
        actor.close()
        with trio.fail_after(5):
            while actor.running:
                await trio.sleep(0.01)
        other.put(2)  # nobody is listening any more: dropped, no error
        actor.inbox.put(3)
        await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    assert actor.seen == [1]
    assert actor.starts == 1 and supervisor.restarts == {}  # ended, not crashed
    other.close()


async def test_more_inboxes_than_zeromqs_default_socket_limit() -> None:
    inboxes = [Inbox(f"many-{i}") for i in range(700)]  # 1,400 sockets: default limit 1,023
    try:
        for i, inbox in enumerate(inboxes):
            inbox.put(i)
        with trio.fail_after(10):
            got = [await inbox.get() for inbox in inboxes]
        assert got == list(range(700))
    finally:
        for inbox in inboxes:
            inbox.close()


async def test_every_message_crosses_as_a_copy_in_order() -> None:
    inbox = Inbox("copies")
    sender = Outbox(inbox.address)
    chunk = m.Chunk("r1", "hi", (1, 2))
    finished = m.Finished("r1", m.FinishReason.LENGTH)
    deliveries = [am.Deliver.of((chunk,)), am.PauseDecoding("r1"), am.Deliver.of((finished,))]
    for msg in deliveries:
        sender.put(msg)
    with trio.fail_after(5):
        taken = [await inbox.get() for _ in deliveries]
    assert taken == deliveries
    assert not any(got is sent for got, sent in zip(taken, deliveries))  # encoded: copies
    assert list(taken[0].chunks()) == [chunk]
    sender.close()
    inbox.close()


async def test_a_sleeping_actor_wakes_for_a_message_from_another_thread() -> None:
    inbox = Inbox("threads")
    async with trio.open_nursery() as nursery:
        got = []

        async def take() -> None:
            got.append(await inbox.get())

        nursery.start_soon(take)
        await trio.testing.wait_all_tasks_blocked()
        def put_from_a_thread() -> None:
            sender = Outbox(inbox.address)
            sender.put(7)
            sender.close()

        await trio.to_thread.run_sync(put_from_a_thread)
        with trio.fail_after(5):
            while not got:
                await trio.sleep(0.01)
    assert got == [7]
    inbox.close()
