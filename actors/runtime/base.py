"""The actor base: one inbox, a handler table, a `run(task_status=...)` entry point.

An actor is a trio task tree that owns its state and talks to others only by messages put in
their inboxes: a ZeroMQ PULL socket, on an `inproc://` address in the daemon's process, each
message one msgpack frame (`registry.CODEC`). Senders hold an `Outbox`; the receiving task
sleeps on its socket. The inbox outlives a crash, the state does not: `run` starts from
`reset()`, after the supervisor called `on_crash`. See docs/architecture.md, "The actors".
"""

from __future__ import annotations

import errno
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
import trio
import zmq

from sluice.actors.runtime.registry import CODEC
from sluice.ipc.sockets import Socket, context

log = structlog.get_logger("sluice.actors")

Handler = Callable[[Any], Awaitable[None]]

_addresses = itertools.count()
_FAIR_SHARE = 16  # messages an actor takes in a row before it lets other tasks run
# errors of an operation that needed a resource the process is out of (a socket's descriptor)
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


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
        try:
            self._socket.send(CODEC.encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # the inbox was closed: its actor is gone for good
            return
        self.sent += 1

    def close(self) -> None:
        self._closed = True
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None


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
    """The address of an actor: anything may `put` a message; only the actor receives.

    The address says where the actor runs: an `inproc://` one (the default) in this process,
    an `ipc://` or `tcp://` one for actors of other processes to reach."""

    def __init__(self, name: str, *, address: str | None = None):
        super().__init__(address or f"inproc://sluice-{next(_addresses)}-{name}")
        self.name = name
        self.taken = 0
        self._in_a_row = 0
        self._receiver = Socket(zmq.PULL)
        self._receiver.zmq.setsockopt(zmq.RCVHWM, 0)
        self._receiver.bind(self.address)
        self._fd = self._receiver.zmq.getsockopt(zmq.FD)

    @property
    def depth(self) -> int:
        """Messages put through this handle and not yet taken by the actor."""
        return self.sent - self.taken

    def close(self) -> None:
        super().close()
        self._receiver.close()  # a task sleeping on it finds it closed

    def get_nowait(self) -> Any:
        """The next message, or `trio.WouldBlock` when there is none.

        Raises `trio.ClosedResourceError` once the inbox is closed."""
        receiver = self._receiver
        if receiver.closed:
            raise trio.ClosedResourceError(f"the inbox of {self.name} is closed")
        try:
            frame = receiver.zmq.recv(zmq.NOBLOCK)
        except zmq.Again:
            raise trio.WouldBlock from None
        self.taken += 1
        return CODEC.decode(frame)

    async def _sleep(self) -> None:
        """Until a message may be there, right after a take found none. One task receives
        from an inbox, so it waits on the socket's descriptor itself. That failed take
        processed the socket's pending commands and drained its descriptor, so the next
        message signals it: no `EVENTS` read is needed to re-arm it (each costs a system
        call, as much as the take itself)."""
        if self._receiver.closed:
            return
        try:
            await trio.lowlevel.wait_readable(self._fd)
        except trio.ClosedResourceError:
            pass  # the next take says so

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
