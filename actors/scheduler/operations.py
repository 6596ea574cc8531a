"""The scheduler actor's operator side: commands from the control socket and what the console
shows.

Status queries are answered here too (`report`, and `detail` for the console). Each command
answers a `CommandReply` to the asker; reconcile fixes what the request table and the block
pool disagree on and says what it found, between two steps (a step in flight holds blocks
for tokens it has not computed yet, which is no discrepancy). The step loop lives in
`actor.py`; this is a mixin of `SchedulerActor` and relies on its `core`, `askers`, `_emit`,
`_maybe_step`, `between_steps_do`, its counters and what it knows of the worker.
"""

from __future__ import annotations

import dataclasses

import structlog

from sluice.actors.scheduler.config import ConfigError, TenantConfig
from sluice.ipc import messages as m

log = structlog.get_logger("sluice.scheduler")


class OperatorCommands:
    async def on_operate(self, msg: m.Operate) -> None:
        command = msg.command
        if isinstance(command, m.CancelCommand):
            out = self.core.abort(command.request_id, reason="cancelled")
            if out is not None:
                self._emit([out])
                self._maybe_step()
            reply = m.CommandReply("cancel", out is not None, f"cancelled {command.request_id}"
                                   if out is not None else f"no live request {command.request_id}")
        elif isinstance(command, m.DrainCommand):
            self.draining = True
            reply = m.CommandReply("drain", True, "draining: new requests are rejected")
        elif isinstance(command, m.ReconcileCommand):
            self.between_steps_do(lambda: self._answer_reconcile(msg))
            return
        elif isinstance(command, m.TenantSet):
            reply = self._set_tenant(command)
        elif isinstance(command, m.InjectFault) and command.kind == "leak_block":
            block = self.core.kv_cache.allocate(1)[0]
            reply = m.CommandReply("fault", True, f"leaked block {block}")
        elif isinstance(command, m.InjectFault) and command.kind == "crash_scheduler":
            # answer first: the control actor must not wait for a reply that never comes
            self.askers.put(msg.reply_to, m.Reply(msg.token, m.CommandReply(
                "fault", True, "the scheduler crashes now")))
            raise RuntimeError("injected scheduler fault")
        elif command == "release_all":
            rids = tuple(self.core.requests)
            self._emit([out for rid in rids if (out := self.core.abort(rid)) is not None])
            reply = m.CommandReply("drain", True,
                                   f"cancelled {len(rids)} requests past the deadline")
        else:
            reply = m.CommandReply("unknown", False, f"the scheduler cannot do {command!r}")
        self.askers.put(msg.reply_to, m.Reply(msg.token, reply))

    async def on_ask(self, msg: m.Ask) -> None:
        """Status for `sluice status` and the daemon, a snapshot for the console; the
        consistency check waits for the gap between two steps."""
        if isinstance(msg.query, m.Subscribe):
            answer = m.ControlSnapshot(0, self.report(), self.detail())
        elif getattr(msg.query, "check_invariants", False):
            self.between_steps_do(lambda: self.askers.put(
                msg.reply_to, m.Reply(msg.token, m.Snapshot(self.report(check=True)))))
            return
        else:
            answer = m.Snapshot(self.report())
        self.askers.put(msg.reply_to, m.Reply(msg.token, answer))

    def report(self, *, check: bool = False) -> m.StatusReport:
        core = self.core
        bm = core.kv_cache
        errors: tuple[str, ...] = ()
        if check:
            try:
                core.check_invariants()
            except AssertionError as exc:
                errors = (str(exc),)
        waiting = len(core.requests) - len(core.running) - len(core.paused)
        state = "draining" if self.draining else "serving"
        return m.StatusReport(
            state=state,
            worker=m.WorkerStatus(self.worker_state, self.worker_restarts, self.worker_pid,
                                  self.worker_failure, *self.worker_dtypes),
            kv=m.KVStatus(bm.num_total_blocks, bm.num_free_blocks, bm.num_used_blocks,
                          bm.num_cached_blocks),
            requests=m.RequestCounts(waiting, len(core.running), len(core.paused)),
            counters=m.Counters(preemptions=core.num_preemptions, **self.counters),
            invariant_errors=errors,
        )

    def _answer_reconcile(self, msg: m.Operate) -> None:
        findings = self.reconcile(msg.connections)
        reply = m.CommandReply("reconcile", True,
                               f"found and fixed {len(findings)} discrepancy(ies)" if findings
                               else "consistent: nothing to fix", tuple(findings))
        self.askers.put(msg.reply_to, m.Reply(msg.token, reply))

    async def on_undrain(self, msg: m.Undrain) -> None:
        self.draining = False

    def _set_tenant(self, command: m.TenantSet) -> m.CommandReply:
        core = self.core
        if command.reset:
            current = TenantConfig()
        elif command.name in core.ledger.tenants:
            current = core.ledger.tenants[command.name].config
        else:
            current = core.config.tenant(command.name)
        changes = {f.name: getattr(command, f.name) for f in dataclasses.fields(current)
                   if getattr(command, f.name) is not None}
        try:
            tenant = dataclasses.replace(current, **changes)
        except ConfigError as exc:
            return m.CommandReply("tenant", False, f"tenant {command.name}: {exc}")
        core.configure_tenant(command.name, tenant)
        self._maybe_step()
        return m.CommandReply("tenant", True, f"tenant {command.name}: {tenant}")

    def reconcile(self, connections: frozenset[bytes]) -> list[str]:
        """Fix what the tables disagree on and say what it was; runs between steps."""
        core, bm = self.core, self.core.kv_cache
        findings: list[str] = []
        gone = []
        for rid in core.requests:
            connection, sep, _ = rid.partition("/")
            if sep and bytes.fromhex(connection) not in connections:
                gone.append(rid)
        outputs = []
        for rid in gone:
            request = core.requests[rid]
            findings.append(f"request {rid} ({request.state.value}, "
                            f"{len(request.block_ids)} blocks) has no live connection: released")
            outputs.append(core.abort(rid, reason="cancelled"))
        for block, extra in self.unowned_references():
            findings.append(f"block {block} had {extra} reference(s) owned by no request: freed")
            bm.free([block] * extra)
        try:
            core.check_invariants()
        except AssertionError as exc:
            findings.append(f"still inconsistent: {exc}")
        self._emit([out for out in outputs if out is not None])
        self._maybe_step()
        if findings:
            log.warning("reconcile fixed discrepancies", count=len(findings))
        return findings

    def unowned_references(self) -> list[tuple[int, int]]:
        """(block, references) for every block referenced more often than requests own it."""
        core = self.core
        owned: dict[int, int] = {}
        for request in core.requests.values():
            for block in request.block_ids:
                owned[block] = owned.get(block, 0) + 1
        counts = (core.kv_cache.ref_count(b) - owned.get(b, 0)
                  for b in range(core.kv_cache.num_total_blocks))
        return [(block, extra) for block, extra in enumerate(counts) if extra > 0]

    def detail(self, max_requests: int = 200) -> dict:
        """What the console shows beyond the status report: plain values only."""
        core = self.core
        now = core.clock()
        stats = core.stats()
        requests = [
            {"id": r.request_id, "tenant": r.tenant, "state": r.state.value,
             "age": now - (r.arrival_time or now), "prompt_tokens": r.num_prompt_tokens,
             "output_tokens": r.num_output_tokens, "blocks": len(r.block_ids),
             "paused": r.state.value == "paused"}
            for r in list(core.requests.values())[:max_requests]
        ]
        stats["requests"] = requests
        stats["latency"] = self.latency.summary(now)
        stats["worker"] = {"state": self.worker_state, "restarts": self.worker_restarts,
                           "pid": self.worker_pid, "failure": self.worker_failure}
        stats["draining"] = self.draining
        return stats
