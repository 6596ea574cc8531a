"""One-for-one supervision: restart a crashed actor with backoff, escalate past a budget.

A crashed child is restarted alone, after `on_crash` let it release what it owned. Restarts
back off exponentially; more than `max_restarts` inside `window` seconds raises `Escalation`
out of the supervisor, which takes the daemon down with a non-zero exit so that systemd can
restart it whole. Only `Exception` is caught: cancellation and KeyboardInterrupt pass through.

A *transient* child (a client connection's Stream) is the client's, not the daemon's: its
crashes never count toward escalation and leave no bookkeeping behind when it ends. It is
restarted (its `on_crash` decides what the restart is for: a Stream comes back closed, only
to refuse what was already routed to it), and one that keeps crashing is closed for good.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import structlog
import trio

from sluice.actors.runtime.base import Actor

log = structlog.get_logger("sluice.supervisor")


class Escalation(Exception):
    """An actor crashed more often than its restart budget allows."""

    def __init__(self, actor_name: str, restarts: int):
        super().__init__(f"{actor_name} crashed {restarts} times inside its restart window")
        self.actor_name = actor_name


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5  # restarts allowed inside `window`
    window: float = 60.0  # seconds
    backoff_initial: float = 0.05  # seconds before the first restart
    backoff_max: float = 2.0


class _StartedOnce:
    """Forwards the first `started()` only, so restarts never call it twice."""

    def __init__(self, task_status: Any):
        self._task_status = task_status
        self.done = False

    def started(self, value: Any = None) -> None:
        if not self.done:
            self.done = True
            self._task_status.started(value)


class Supervisor:
    """Runs children (static or started later) and restarts them one for one."""

    def __init__(self, policy: RestartPolicy = RestartPolicy(), name: str = "supervisor"):
        self.policy = policy
        self.name = name
        self.restarts: dict[str, int] = {}  # total restarts per child name, for status
        self._nursery: trio.Nursery | None = None
        self._scopes: dict[int, trio.CancelScope] = {}
        self._ended: dict[int, trio.Event] = {}  # set when a child's supervision ends

    async def run(
        self, children: list[Actor] = (), *, task_status: Any = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for child in children:
                await nursery.start(self._supervise, child)
            task_status.started(self)
            await trio.sleep_forever()

    async def start_child(self, child: Actor, *, transient: bool = False) -> None:
        """Start a child under supervision and return once it serves (or, transient, gave up)."""
        assert self._nursery is not None, "supervisor is not running"
        await self._nursery.start(self._supervise, child, transient)

    def stop_child(self, child: Actor) -> None:
        scope = self._scopes.get(id(child))
        if scope is not None:
            scope.cancel()

    def supervises(self, child: Actor) -> bool:
        """Whether `child` is under supervision now (running, or waiting to restart)."""
        return id(child) in self._scopes

    async def stopped(self, child: Actor) -> None:
        """Return once `child` is not under supervision (at once if it is not)."""
        ended = self._ended.get(id(child))
        if ended is not None:
            await ended.wait()

    async def _supervise(self, child: Actor, transient: bool = False, *,
                         task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        status = _StartedOnce(task_status)
        crashes: deque[float] = deque()
        backoff = self.policy.backoff_initial
        ended = self._ended[id(child)] = trio.Event()
        with trio.CancelScope() as scope:
            self._scopes[id(child)] = scope
            try:
                while True:
                    started_at = trio.current_time()
                    try:
                        await child.run(task_status=status)
                        return  # a clean return means the child is done for good
                    except Exception as exc:
                        await self._after_crash(child, exc)
                        now = trio.current_time()
                        if now - started_at > self.policy.window:
                            backoff = self.policy.backoff_initial
                        crashes.append(now)
                        while crashes and now - crashes[0] > self.policy.window:
                            crashes.popleft()
                        if len(crashes) > self.policy.max_restarts:
                            if transient:
                                log.error("transient actor closed for good", actor=child.name)
                                child.close()
                                return
                            raise Escalation(child.name, len(crashes)) from exc
                    if not transient:
                        self.restarts[child.name] = self.restarts.get(child.name, 0) + 1
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, self.policy.backoff_max)
            finally:
                self._scopes.pop(id(child), None)
                if self._ended.get(id(child)) is ended:
                    del self._ended[id(child)]
                ended.set()
                if transient:  # one that gave up before serving must not fail its starter
                    status.started()

    async def _after_crash(self, child: Actor, exc: Exception) -> None:
        log.error("actor crashed", actor=child.name, error=repr(exc))
        try:
            with trio.move_on_after(5):
                await child.on_crash(exc)
        except Exception as hook_exc:  # a broken cleanup must not stop the restart
            log.error("crash cleanup failed", actor=child.name, error=repr(hook_exc))
