"""The actor base: one inbox, a handler table, a `run(task_status=...)` entry point.

An actor is a trio task tree that owns its state and talks to others only by messages put in
their inboxes (a ZeroMQ PULL socket on an `inproc://` address; senders hold an `Outbox`). The
inbox outlives a crash, the state does not: `run` starts from `reset()`, after the supervisor
called `on_crash`. The messages of the per-token path (`HANDED_OVER`) are handed over as
objects within one process rather than encoded, and receivers sleep on a bell the sender rings:
a shortcut being replaced. See docs/architecture.md, "The actors" and "Where the code differs
from this picture".
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import itertools
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
import trio
import zmq

from sluice.actors.runtime import messages as am
from sluice.actors.executor import protocol
from sluice.actors.runtime.registry import CODEC
from sluice.ipc import messages as m
from sluice.ipc.sockets import EVENTS, POLLIN, Socket, context

log = structlog.get_logger("sluice.actors")

Handler = Callable[[Any], Awaitable[None]]

# Handed over, not encoded, between the actors of one process: a step's plan and result in
# the worker's encoding (the executor relays their bytes), its outputs (built for the
# tokenizer and given away), the chunks rendered from them, the client frames encoded from
# those, the client's own messages (decoded once, at the gateway), a request's way to
# admission (Encode, Admit) and the usage records of its end. All but StepOutputs
# are frozen and built of immutable values.
HANDED_OVER = frozenset({
    protocol.PlanFrame, protocol.ResultFrame, am.StepOutputs, am.Deliver, am.Outbound,
    m.Generate, m.Credit, m.Cancel, m.Heartbeat,
    am.Encode, am.Admit, am.Ended,
})
_GIVEN_AWAY = frozenset({am.StepOutputs})  # mutable, but the sender keeps no reference
# tests set this to check, at every hand-over, that a frozen message holds no mutable value
_CHECK_HANDED_OVER = os.environ.get("SLUICE_CHECK_HANDED_OVER") == "1"
_HANDED = b"\xc1"  # first byte of a handed-over message's frame: never a msgpack message's
_handed: dict[str, dict[int, Any]] = {}  # inbox address -> number -> message not yet taken
# inbox address -> messages sent to it by this thread's puts and not yet taken: a receiver
# with none waiting does not ask its socket, whose failed read costs a poll() and an exception
_waiting: dict[str, list[int]] = {}
_handed_numbers = itertools.count()
# inbox address -> the event its receiving task sleeps on, and that task's trio run
_bells: dict[str, tuple[trio.Event, trio.lowlevel.TrioToken]] = {}
_sleepers_thread: int | None = None  # the thread that made the first inbox; actors run there
_foreign_puts = False  # some thread other than that one has put a message
_addresses = itertools.count()
_FAIR_SHARE = 16  # messages an actor takes in a row before it lets other tasks run
# errors of an operation that needed a resource the process is out of (a socket's descriptor)
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def check_immutable(value: Any) -> None:
    """Raise `TypeError` if `value` holds anything another actor could change under it."""
    if value is None or isinstance(value, (int, float, str, bytes, enum.Enum)):
        return
    if type(value) in (tuple, frozenset):
        for item in value:
            check_immutable(item)
        return
    if dataclasses.is_dataclass(value) and type(value).__dataclass_params__.frozen:
        for field in dataclasses.fields(value):
            check_immutable(getattr(value, field.name))
        return
    raise TypeError(f"a {type(value).__name__} is mutable: it cannot be handed to another actor")


class Outbox:
    """A sending handle to one actor's inbox; `put` never waits.

    Queues are unbounded on purpose (high-water marks of 0): actors form cycles
    (scheduler -> stream -> scheduler), so a bounded queue could deadlock two actors waiting
    on each other. Flow control lives at the edges instead: credits for clients, admission
    limits for requests, and the scheduler pacing steps by the depths the actors downstream
    report of their own inboxes (`reports.Backlog`).
    """

    def __init__(self, address: str):
        self.address = address
        self.sent = 0
        self._socket: zmq.Socket | None = None
        self._closed = False

    def put(self, msg: Any) -> None:
        """Deliver without waiting; messages to a closed inbox are dropped."""
        if self._closed:
            return
        if self._socket is None:
            try:
                self._socket = context().socket(zmq.PUSH)
            except zmq.ZMQError as exc:
                if exc.errno not in RESOURCE_ERRNOS:
                    raise
                # out of descriptors: this message is lost, not the sender (a crash could
                # escalate and take every connection down); the next put tries again. The
                # connection cap is sized so that this does not happen
                log.error("message lost", to=self.address, type=type(msg).__name__,
                          error=exc.strerror)
                return
            self._socket.setsockopt(zmq.SNDHWM, 0)
            self._socket.connect(self.address)
        address = self.address
        pending = _handed.get(address) if type(msg) in HANDED_OVER else None
        if pending is None:
            frame, number = CODEC.encode(msg), None
        else:
            if _CHECK_HANDED_OVER and type(msg) not in _GIVEN_AWAY:
                check_immutable(msg)
            number = next(_handed_numbers)
            pending[number] = msg
            frame = _HANDED + number.to_bytes(8, "little")
        try:
            self._socket.send(frame, zmq.NOBLOCK)
        except zmq.Again:  # the inbox was closed: its actor is gone for good
            if pending is not None:
                pending.pop(number, None)
            return
        self.sent += 1
        if threading.get_ident() != _sleepers_thread:
            global _foreign_puts
            _foreign_puts = True
        else:
            waiting = _waiting.get(address)
            if waiting is not None:
                waiting[0] += 1
        if address in _bells:
            _ring(address)

    def close(self) -> None:
        self._closed = True
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None


def _ring(address: str) -> None:
    """Wake the task sleeping on the inbox at `address` (from any thread)."""
    bell = _bells.pop(address, None)
    if bell is None:
        return
    event, run = bell
    try:
        here = trio.lowlevel.current_trio_token()
    except RuntimeError:  # not in a trio run
        here = None
    if here is run:
        event.set()
        return
    try:
        run.run_sync_soon(event.set)
    except trio.RunFinishedError:
        pass


class Outboxes:
    """Outboxes by address, for actors that answer whoever a message names (`reply_to`)."""

    def __init__(self) -> None:
        self._boxes: dict[str, Outbox] = {}

    def put(self, address: str, msg: Any) -> None:
        if not address:
            return  # the sender wanted no answer
        box = self._boxes.get(address)
        if box is None:
            box = self._boxes[address] = Outbox(address)
        box.put(msg)

    def forget(self, address: str) -> None:
        box = self._boxes.pop(address, None)
        if box is not None:
            box.close()

    def close(self) -> None:
        for box in self._boxes.values():
            box.close()
        self._boxes.clear()


class Inbox(Outbox):
    """The address of an actor: anything may `put` a message; only the actor receives."""

    def __init__(self, name: str):
        super().__init__(f"inproc://sluice-{next(_addresses)}-{name}")
        self.name = name
        self.taken = 0
        self._in_a_row = 0
        self._receiver = Socket(zmq.PULL)
        self._receiver.zmq.setsockopt(zmq.RCVHWM, 0)
        self._receiver.bind(self.address)
        self._handed = _handed[self.address] = {}
        self._waiting = _waiting[self.address] = [0]
        global _sleepers_thread
        if _sleepers_thread is None:  # puts from any other thread count as foreign
            _sleepers_thread = threading.get_ident()

    @property
    def depth(self) -> int:
        """Messages put through this handle and not yet taken by the actor."""
        return self.sent - self.taken

    def close(self) -> None:
        super().close()
        self._receiver.close()
        _ring(self.address)  # a task sleeping on it finds it closed
        _handed.pop(self.address, None)  # with the frames that named them, never taken
        self._handed.clear()
        _waiting.pop(self.address, None)

    def get_nowait(self) -> Any:
        """The next message, or `trio.WouldBlock` when there is none.

        Raises `trio.ClosedResourceError` once the inbox is closed."""
        if self._receiver.closed:
            raise trio.ClosedResourceError(f"the inbox of {self.name} is closed")
        waiting = self._waiting
        if waiting[0] <= 0 and not _foreign_puts:
            raise trio.WouldBlock
        try:
            frame = self._receiver.zmq.recv(zmq.NOBLOCK)
        except zmq.Again:
            raise trio.WouldBlock from None
        waiting[0] -= 1
        self.taken += 1
        if frame[:1] == _HANDED:
            return self._handed.pop(int.from_bytes(frame[1:], "little"))
        return CODEC.decode(frame)

    async def _sleep(self) -> None:
        """Until a message may be there.

        Every message comes through an `Outbox.put` of this process, which rings the
        inbox's bell once it has sent: no wait on the socket's FD, whose `EVENTS` reads and
        epoll registrations cost more than the rest of a hop. One task receives, so one
        bell per inbox."""
        event = trio.Event()
        _bells[self.address] = (event, trio.lowlevel.current_trio_token())
        try:
            if self._receiver.closed:
                return
            # a put from another thread may have come between the failed take and the bell
            foreign = _foreign_puts or threading.get_ident() != _sleepers_thread
            if foreign and self._receiver.zmq.get(EVENTS) & POLLIN:
                return
            await event.wait()
        finally:
            if _bells.get(self.address, (None,))[0] is event:
                del _bells[self.address]

    async def get(self) -> Any:
        while True:
            try:
                msg = self.get_nowait()
            except trio.WouldBlock:
                self._in_a_row = 0
                await self._sleep()
                continue
            self._in_a_row += 1
            if self._in_a_row >= _FAIR_SHARE:
                self._in_a_row = 0
                # taken already: a cancel here (an actor stopped to restart) must not lose it
                await trio.lowlevel.cancel_shielded_checkpoint()
            return msg


class Actor:
    """Subclasses fill `handlers()`, and override `reset`, `background` and `on_crash`."""

    name = "actor"

    def __init__(self, name: str | None = None, *, inbox: Inbox | None = None):
        if name is not None:
            self.name = name
        self.inbox = inbox or Inbox(self.name)
        self.running = False

    def handlers(self) -> dict[type, Handler]:
        return {}

    def reset(self) -> None:
        """Build fresh state; called at every (re)start."""

    async def background(self, nursery: trio.Nursery) -> None:
        """Start the actor's own tasks (timers, socket readers) before it serves."""

    async def on_crash(self, exc: BaseException) -> None:
        """Called by the supervisor with the crashed state still in place."""

    def after_message(self) -> None:
        """Called after each handled message (actors that batch output flush here)."""

    def teardown(self) -> None:
        """Release what `reset` acquired (sockets, processes); runs however `run` ends."""

    def close(self) -> None:
        """Close the inbox and any outboxes, for good: the actor will not run again."""
        self.inbox.close()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.reset()
        table = self.handlers()
        try:
            async with trio.open_nursery() as nursery:
                await self.background(nursery)
                self.running = True
                task_status.started()
                try:
                    while True:
                        try:
                            msg = await self.inbox.get()
                        except trio.ClosedResourceError:
                            return  # closed for good: this actor is done
                        handler = table.get(type(msg))
                        if handler is None:
                            log.warning(
                                "unhandled message", actor=self.name, type=type(msg).__name__
                            )
                            continue
                        await handler(msg)
                        self.after_message()
                finally:
                    self.running = False
                    nursery.cancel_scope.cancel()
        finally:
            self.teardown()
