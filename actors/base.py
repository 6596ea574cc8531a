"""The actor base: one inbox, a handler table, a `run(task_status=...)` entry point.

An actor is a trio task tree that owns its state and talks to others only by messages put
in their inboxes. The inbox outlives a crash (senders keep their handle), the state does
not: `run` starts from `reset()`, and the supervisor calls `on_crash` first so an actor that
owned requests can release them. Supervision itself lives in `supervisor.py`.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
import trio

log = structlog.get_logger("sluice.actors")

Handler = Callable[[Any], Awaitable[None]]


class Inbox:
    """The address of an actor: anything may `put` a message; only the actor receives."""

    def __init__(self, name: str):
        self.name = name
        # Unbounded on purpose: actors form cycles (scheduler -> stream -> scheduler), so a
        # bounded inbox could deadlock two actors waiting on each other. Flow control lives
        # at the edges instead: credits for clients, admission limits for requests.
        self._send, self._recv = trio.open_memory_channel[Any](math.inf)

    def put(self, msg: Any) -> None:
        """Deliver without waiting; messages to a closed inbox are dropped."""
        try:
            self._send.send_nowait(msg)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    @property
    def depth(self) -> int:
        return self._send.statistics().current_buffer_used

    def close(self) -> None:
        self._send.close()

    async def get(self) -> Any:
        return await self._recv.receive()


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
                        msg = await self.inbox.get()
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
