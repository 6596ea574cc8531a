"""The Control actor: the operator-facing ROUTER socket.

Requests are decoded with the control codec and answered one at a time; status comes from
the Scheduler as a `Snapshot`, completed with the gateway's counters and what the daemon
runs (`DaemonFacts`, given at construction). Bad frames get `Rejected` naming the problem.
Subscribers get a `ControlSnapshot` every 250 ms until their subscription lapses. Operator
commands (drain, resume, reconcile, recover, cancel, tenant set) are answered with a
`CommandReply`; what the scheduler owns is done by the scheduler (`Operate`), the
`vanish_stream` fault by the gateway (`Operate`), the worker's restart and the `worker_down`
fault by hooks the daemon provides (they start and stop a supervised actor). Fault injection
exists only when the daemon was configured for it. A number no daemon takes (a negative or
NaN drain deadline, an infinite weight, an integer past 2**53) is `Rejected` naming its field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import structlog
import trio
import zmq

from sluice.actors.runtime import messages as am
from sluice.actors.runtime.base import Actor, Handler, Outbox, Outboxes
from sluice.actors.runtime.local_socket import bind_private
from sluice.actors.runtime.questions import Questions
from sluice.actors.runtime.reports import Endpoint, EndpointQuery
from sluice.ipc import messages as m
from sluice.ipc.codec import Codec, CodecError
from sluice.ipc.sockets import PeerGone, Socket

log = structlog.get_logger("sluice.control")


SNAPSHOT_INTERVAL = 0.25  # seconds between snapshots to subscribers
# past 2**53 an integer is no longer exact as a float, which limits become (token rates)
MAX_EXACT_INT = 2**53
WEIGHTS = (1e-6, 1e6)  # a tenant's fair-share weight; outside, shares overflow or vanish


def invalid_field(command: object) -> tuple[str, str] | None:
    """(field, what is wrong) for the first number of an operator command no daemon takes:
    NaN or infinite, an integer past `MAX_EXACT_INT`, a negative drain deadline, a positive
    weight outside `WEIGHTS`. Limits' own ranges (> 0, >= 1) are the scheduler's to say."""
    if isinstance(command, m.DrainCommand) and command.deadline is not None:
        deadline = command.deadline
        if not (math.isfinite(deadline) and deadline >= 0):
            return "deadline", (f"must be a number of seconds >= 0 (none: wait for every "
                                f"running request), got {deadline!r}")
    if isinstance(command, m.TenantSet) and command.weight is not None:
        low, high = WEIGHTS  # (<= 0 is the scheduler's to refuse, as for the config file)
        if command.weight > 0 and not low <= command.weight <= high:
            return "weight", f"must be from {low:g} to {high:g}, got {command.weight!r}"
    for field in dataclasses.fields(command):
        value = getattr(command, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            return field.name, f"must be a finite number, got {value!r}"
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_EXACT_INT:
            return field.name, f"must be at most {MAX_EXACT_INT} in size, got {value}"
    return None


@dataclass
class ControlHooks:
    """What the daemon lets the Control actor do beyond messages."""

    gateway: Outbox | None = None  # told Drain / EndDrain, asked for live connections
    # where cancels and a drain's release go, on the route requests take to the scheduler
    # (None: straight to the scheduler, for a daemon without one)
    tokenizer: Outbox | None = None
    recover: Callable[[], Awaitable[str]] | None = None  # restart the worker; a line to report
    # debug-only faults by kind; None when the daemon does not allow fault injection
    faults: dict[str, Callable[[], Awaitable[str]]] | None = None
    http: Outbox | None = None  # the HTTP front, when enabled: told and asked as the gateway

    def fronts(self) -> list[Outbox]:
        """The front doors, each with live streams of its own."""
        return [front for front in (self.gateway, self.http) if front is not None]


class Control(Actor):
    name = "control"

    def __init__(self, address: str, *, scheduler: Outbox, hooks: ControlHooks | None = None,
                 facts: m.DaemonFacts = m.DaemonFacts()):
        super().__init__()
        self.hooks = hooks or ControlHooks()
        self.facts = facts  # what the daemon runs: part of every status it answers
        self.subscribers: dict[bytes, float] = {}  # identity -> subscription end (trio clock)
        self.seq = 0
        self.drain_epoch = 0  # bumped by resume, so an old drain deadline does nothing
        self.listen = address
        self.address: str | None = None
        self.scheduler = scheduler
        self.codec = Codec(m.CONTROL_REQUESTS)
        # answers of the scheduler and the gateway; a `Reply` names the question by token
        self.questions = Questions("control-replies")
        self.askers = Outboxes()  # who asked this actor (the daemon, for the bound address)

    def reset(self) -> None:
        self.socket = Socket(zmq.ROUTER)
        # checked directory, a live daemon's socket never taken over, born 0600 (no chmod)
        self.address = bind_private(self.socket, self.address or self.listen)

    def teardown(self) -> None:
        self.socket.close()

    def close(self) -> None:
        super().close()
        self.questions.close()
        self.askers.close()

    def handlers(self) -> dict[type, Handler]:
        return {am.Ask: self.on_ask}

    async def on_ask(self, msg: am.Ask) -> None:
        if isinstance(msg.query, EndpointQuery):
            self.askers.put(msg.reply_to, am.Reply(msg.token, Endpoint(self.address)))

    async def background(self, nursery: trio.Nursery) -> None:
        self._send_lock = trio.Lock()
        self._nursery = nursery
        nursery.start_soon(self.questions.take_replies)
        nursery.start_soon(self._serve)
        nursery.start_soon(self._publish)

    async def _ask(self, actor: Outbox, question: Callable[[str, int], object]) -> object:
        return await self.questions.ask(actor, question)

    async def gateway_state(self) -> am.Connections | None:
        """The live client connections and the edge's counters (None without a gateway)."""
        if self.hooks.gateway is None:
            return None
        return await self._ask(self.hooks.gateway,
                               lambda address, token: am.Ask(am.ListConnections(), address, token))

    async def connection_ids(self) -> frozenset[bytes] | None:
        """The live client connections, from every front door (None without one)."""
        ids: frozenset[bytes] | None = None
        for front in self.hooks.fronts():
            state = await self._ask(front, lambda address, token: am.Ask(
                am.ListConnections(), address, token))
            ids = (ids or frozenset()) | state.ids
        return ids

    async def status(self, query: m.StatusQuery) -> m.StatusReport:
        snapshot = await self._ask(self.scheduler,
                                   lambda address, token: am.Ask(query, address, token))
        return await self._completed(snapshot.report)

    async def _completed(self, report: m.StatusReport) -> m.StatusReport:
        """The scheduler's report with what others know: the edge's and the daemon's facts."""
        report = replace(report, daemon=self.facts)
        edge = await self.gateway_state()
        if edge is not None:
            report = replace(report, connections=len(edge.ids), gateway=edge.stats)
        if self.hooks.http is not None:  # its refusals while draining count with the gateway's
            http = await self._ask(self.hooks.http, lambda address, token: am.Ask(
                am.ListConnections(), address, token))
            refused = report.gateway.drain_refusals + http.stats.drain_refusals
            report = replace(report, gateway=replace(report.gateway, drain_refusals=refused))
        return report

    async def _serve(self) -> None:
        while True:
            identity, *rest = await self.socket.recv_multipart()
            try:
                if len(rest) != 1:
                    raise CodecError("expected exactly one frame", field="frame")
                query = self.codec.decode(rest[0])
                if problem := invalid_field(query):
                    field, why = problem
                    raise CodecError(f"{field} {why}", field=field)
                if isinstance(query, m.StatusQuery):
                    answer = await self.status(query)
                else:
                    answer = await self.command(identity, query)
            except CodecError as exc:
                answer = m.Rejected(exc.request_id, exc.code, exc.message, exc.field)
            await self._send(identity, answer)

    async def _send(self, identity: bytes, answer: object) -> bool:
        async with self._send_lock:
            try:
                await self.socket.send_multipart([identity, self.codec.encode(answer)])
            except PeerGone:
                return False
        return True

    async def snapshot(self) -> m.ControlSnapshot:
        snap = await self._ask(self.scheduler,
                               lambda address, token: am.Ask(m.Subscribe(), address, token))
        self.seq += 1
        return replace(snap, seq=self.seq, status=await self._completed(snap.status))

    async def _publish(self) -> None:
        while True:
            await trio.sleep(SNAPSHOT_INTERVAL)
            now = trio.current_time()
            for identity, until in list(self.subscribers.items()):
                if until < now:
                    del self.subscribers[identity]
            if not self.subscribers:
                continue
            snap = await self.snapshot()
            for identity in list(self.subscribers):
                if not await self._send(identity, snap):
                    self.subscribers.pop(identity, None)

    async def _operate(self, command: object, actor: Outbox | None = None) -> m.CommandReply:
        """Have `actor` (the scheduler unless named) carry out a command; its reply."""
        connections = frozenset()  # only reconcile looks at them: ask the gateway only then
        if isinstance(command, m.ReconcileCommand):
            connections = await self.connection_ids() or frozenset()
        if actor is None and isinstance(command, (m.CancelCommand, am.ReleaseAll)):
            actor = self.hooks.tokenizer  # it holds the requests still being tokenized
        return await self._ask(
            actor or self.scheduler,
            lambda address, token: am.Operate(command, address, token, connections))

    async def command(self, identity: bytes, command: object) -> object:
        """Carry out one operator command and say what happened."""
        hooks = self.hooks
        if isinstance(command, m.Subscribe):
            self.subscribers[identity] = trio.current_time() + max(0.5, min(command.ttl, 60.0))
            return await self.snapshot()
        if isinstance(command, m.DrainCommand):
            for front in hooks.fronts():
                front.put(am.Drain())
            answer = await self._operate(command)
            if command.deadline is not None:
                self._nursery.start_soon(self._drain_deadline, command.deadline, self.drain_epoch)
            log.info("drain", deadline=command.deadline)
            return answer
        if isinstance(command, m.ResumeCommand):
            self.drain_epoch += 1
            for front in hooks.fronts():
                front.put(am.EndDrain())
            self.scheduler.put(am.EndDrain())
            log.info("resume")
            return m.CommandReply("resume", True, "admitting again")
        if isinstance(command, m.RecoverCommand):
            if hooks.recover is None:
                return m.CommandReply("recover", False, "this daemon cannot restart its worker")
            message = await hooks.recover()
            log.info("recover", result=message)
            return m.CommandReply("recover", True, message)
        if isinstance(command, m.InjectFault):
            if hooks.faults is None:
                return m.CommandReply("fault", False, "fault injection is disabled")
            if command.kind in ("leak_block", "crash_scheduler"):  # done by the scheduler
                return await self._operate(command)
            if command.kind == "vanish_stream" and hooks.gateway is not None:
                return await self._operate(command, hooks.gateway)
            inject = hooks.faults.get(command.kind)
            if inject is None:
                return m.CommandReply("fault", False, f"unknown fault {command.kind!r}")
            return m.CommandReply("fault", True, await inject())
        answer = await self._operate(command)
        log.info("operator command", command=answer.command, ok=answer.ok)
        return answer

    async def _drain_deadline(self, deadline: float, epoch: int) -> None:
        await trio.sleep(deadline)
        if epoch == self.drain_epoch:
            await self._operate(am.ReleaseAll())

