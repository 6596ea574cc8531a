"""The Scheduler actor: a thin trio shell that drives the scheduler core with messages.

It admits what the Tokenizer sends, keeps at most one `StepPlan` in flight at the Executor,
applies each `StepResult` and hands the outputs to the Tokenizer; releases apply at once, so
their KV is free in the same iteration. It handles a worker lost (recompute, bisection), out of
memory (a smaller budget) or failed, ends alone a request whose own data fails, paces its steps
by the downstream backlog, starts each incarnation in a new epoch, and answers status and
operator commands with `commands.py`. See docs/architecture.md, "A token's path", "Failure
semantics" and "The scheduler actor's epochs".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import structlog
import trio

from sluice.actors.runtime import messages as am
from sluice.actors.scheduler import commands
from sluice.actors.runtime.base import Actor, Handler, Inbox, Outbox, Outboxes
from sluice.actors.executor.protocol import PlanFrame, ResultFrame, StepOutOfMemory
from sluice.actors.executor.worker import decode_result, encode_plan
from sluice.actors.front.limits import Limits, clip
from sluice.actors.runtime.reports import Backlog, Histogram, MetricsQuery, MetricsSnapshot
from sluice.actors.scheduler import Request, Scheduler
from sluice.actors.scheduler.latency import LatencyLog
from sluice.actors.scheduler.plan import RequestOutput, StepOutputs, StepPlan, StepResult
from sluice.actors.scheduler.step_budget import StepBudget
from sluice.ipc import messages as m
from sluice.ipc.vocabulary import RejectedError

log = structlog.get_logger("sluice.scheduler")
_LOG_LIMITS = Limits()  # request ids carry the client's own id: logged cut to the default width

_CANCELLED = frozenset((m.FinishReason.CANCELLED, m.FinishReason.TIMEOUT))  # counted apart
EPOCH_BITS = 32  # the step id sent to the executor: epoch << EPOCH_BITS | the core's step id
# seconds an admission's `Accepted` may wait to go out with the outputs of the step in flight
# (and so in the same client frame as that step's chunks) before it goes on its own
ACCEPTED_HOLD = 0.005


class SchedulerActor(Actor):
    name = "scheduler"

    def __init__(
        self,
        make_core: Callable[[], Scheduler],
        *,
        tokenizer: Outbox,
        executor: Outbox,
        worker_ready: bool = False,
        inbox: Inbox | None = None,
        downstream_limit: int = 256,
        max_step_losses: int = 3,
        latency_histograms: bool = False,
    ):
        super().__init__(inbox=inbox)
        # untaken messages of the actors downstream, by actor, as they last reported them
        self.backlog: dict[str, int] = {}
        self.downstream_limit = downstream_limit
        self.max_step_losses = max_step_losses
        self.make_core = make_core
        self.tokenizer = tokenizer
        self.executor = executor
        self.initial_worker_ready = worker_ready
        self.counters = {"accepted": 0, "finished": 0, "cancelled": 0, "rejected": 0}
        self.epoch = 0  # incarnations of this actor; part of every step id it sends
        self.oom_steps = 0  # steps the worker ran out of memory in
        self.draining = False
        self.latency = LatencyLog(histograms=latency_histograms)
        self.askers = Outboxes()  # whoever sent Ask or Operate (the control actor)

    def reset(self) -> None:
        self.epoch += 1
        self.core = self.make_core()
        self.step_budget = StepBudget.for_config(self.core.config)
        self.in_flight: StepPlan | None = None
        self.deferred: list[am.PauseDecoding | am.ResumeDecoding] = []
        self.between_steps: list[Callable[[], None]] = []  # checks that wait for no step
        self.worker_ready = self.initial_worker_ready
        self.worker_state = "ready" if self.worker_ready else "starting"
        self.worker_restarts = 0
        self.worker_pid = 0
        self.worker_rank_pids: tuple[int, ...] = ()
        self.worker_failure = ""
        self.worker_dtypes = ("", "")  # (weights, KV), from the worker's WorkerReady
        self.waiting_for_room = False
        # admitted since the last outputs: told to the tokenizer with the next ones
        self.admitted: list[tuple[str, int]] = []
        self.admission_held = trio.Event()  # set while some wait for the step in flight
        # the worker's state was known to the old incarnation only: ask again (the answer,
        # WorkerReady or WorkerFailed, lands in the inbox like any announcement)
        self.executor.put(am.AskWorker())

    async def background(self, nursery: trio.Nursery) -> None:
        self.deadline_set = trio.Event()
        nursery.start_soon(self._expire_deadlines)
        nursery.start_soon(self._send_held_admissions)

    async def _expire_deadlines(self) -> None:
        """End requests past their deadline (`timeout`), stepping or not: a request that
        waits while no worker is up times out too."""
        while True:
            due = self.core.next_deadline()
            if due is None:
                await self.deadline_set.wait()
                self.deadline_set = trio.Event()
                continue
            # a later arrival may have an earlier deadline: look again at least this often
            await trio.sleep(min(0.1, max(0.0, due - self.core.clock())))
            outputs = self.core.expire()
            if outputs:
                self._emit_ended(outputs)
                self._maybe_step()

    async def _send_held_admissions(self) -> None:
        """An admission held for the step in flight waits at most `ACCEPTED_HOLD`: a slow or
        hung step does not hold up its `Accepted`."""
        while True:
            await self.admission_held.wait()
            self.admission_held = trio.Event()
            await trio.sleep(ACCEPTED_HOLD)
            self._emit(StepOutputs())  # what a step's outputs did not take meanwhile

    def handlers(self) -> dict[type, Handler]:
        return {
            am.Admit: self.on_admit,
            am.Release: self.on_release,
            am.StopMatched: self.on_stop_matched,
            am.PauseDecoding: self.on_pause_or_resume,
            am.ResumeDecoding: self.on_pause_or_resume,
            ResultFrame: self.on_result_frame,
            StepOutOfMemory: self.on_step_out_of_memory,
            am.WorkerLost: self.on_worker_lost,
            am.WorkerReady: self.on_worker_ready,
            am.WorkerFailed: self.on_worker_failed,
            am.Drain: self.on_drain,
            am.Ask: self.on_ask,
            am.Operate: self.on_operate,
            am.EndDrain: self.on_end_drain,
            Backlog: self.on_backlog,
        }

    def _downstream_busy(self) -> bool:
        return sum(self.backlog.values()) > self.downstream_limit

    async def on_backlog(self, msg: Backlog) -> None:
        self.backlog[msg.actor] = msg.depth
        if self.waiting_for_room and not self._downstream_busy():
            self.waiting_for_room = False
            self._maybe_step()

    # -- requests -----------------------------------------------------------------------------

    async def on_admit(self, msg: am.Admit) -> None:
        if self.draining:
            self.counters["rejected"] += 1
            self.tokenizer.put(am.AdmissionRefused(msg.request_id, m.RejectCode.DRAINING,
                                         "the daemon is draining"))
            return
        if self.worker_state == "failed":
            self.counters["rejected"] += 1
            self.tokenizer.put(am.AdmissionRefused(msg.request_id, m.RejectCode.OVERLOADED,
                                         worker_failed_message(self.worker_failure), "worker"))
            return
        try:
            request = Request(msg.request_id, list(msg.prompt_ids), msg.sampling,
                              tenant=msg.tenant, priority=msg.priority, arrival_time=msg.arrival,
                              timeout=msg.timeout)
            self.core.add_request(request)
        except RejectedError as exc:
            self.counters["rejected"] += 1
            self.tokenizer.put(am.AdmissionRefused(msg.request_id, exc.code, exc.message,
                                                   exc.field, exc.retry_after))
            return
        except Exception as exc:  # this request's data broke its admission: it alone ends
            self._fail_requests([msg.request_id], exc)
            return
        if self.core.next_deadline() is not None:
            self.deadline_set.set()
        self.counters["accepted"] += 1
        self.admitted.append((msg.request_id, len(msg.prompt_ids)))
        self._maybe_step()
        if self.in_flight is None:  # no step's outputs to go with: its `Accepted` goes now
            self._emit(StepOutputs())
        else:
            self.admission_held.set()

    async def on_release(self, msg: am.Release) -> None:
        self._emit_ended([out for rid in msg.request_ids
                    if (out := self.core.abort(rid, msg.reason)) is not None])
        self._maybe_step()

    async def on_stop_matched(self, msg: am.StopMatched) -> None:
        # the tokenizer holds the request's Finished until this end, which carries its cost;
        # one the core no longer has ended meanwhile, and that end is on its way already
        out = self.core.finish(msg.request_id)
        if out is not None:
            self._emit_ended([out])
        self._maybe_step()

    async def on_pause_or_resume(self, msg: am.PauseDecoding | am.ResumeDecoding) -> None:
        if self.in_flight is not None:
            self.deferred.append(msg)
            return
        self._apply_pause_or_resume(msg)
        self._maybe_step()

    def _apply_pause_or_resume(self, msg: am.PauseDecoding | am.ResumeDecoding) -> None:
        if isinstance(msg, am.PauseDecoding):
            self.core.pause(msg.request_id)
        else:
            self.core.resume(msg.request_id)

    # -- steps --------------------------------------------------------------------------------

    def _wire_step_id(self, plan: StepPlan) -> int:
        return self.epoch << EPOCH_BITS | plan.step_id

    async def on_result_frame(self, msg: ResultFrame) -> None:
        await self.on_step_result(decode_result(msg.frame))

    async def on_step_result(self, result: StepResult) -> None:
        plan = self.in_flight
        if plan is None or self._wire_step_id(plan) != result.step_id:
            # a step voided by WorkerLost, or one planned by an earlier incarnation of this
            # actor (its core, and the requests it named, are gone)
            log.debug("stale step result ignored", step_id=result.step_id)
            return
        self.in_flight = None
        if plan.seqs:  # not a plan that only waited for grammars
            self.step_budget.step_ran()
            self.latency.step(plan, trio.current_time() - self.step_sent)
        self._emit(self.core.update(plan, result))
        self._after_step()

    async def on_step_out_of_memory(self, msg: StepOutOfMemory) -> None:
        plan = self.in_flight
        if plan is None or self._wire_step_id(plan) != msg.step_id:
            return  # voided already, as for a result
        self.oom_steps += 1
        cfg = self.core.config
        used = plan.prefill_tokens * cfg.prefill_weight + plan.decode_tokens * cfg.decode_weight
        if not self.step_budget.out_of_memory(used):
            log.error("step out of memory at the smallest budget: replacing the worker",
                      tokens=plan.num_tokens)
            self.executor.put(am.Recover())
            await self.on_worker_lost(am.WorkerLost("out of memory at the smallest step"))
            return
        self.in_flight = None
        log.warning("step out of memory: planned again smaller", tokens=plan.num_tokens,
                    token_budget=self.step_budget.limit)
        self._emit(self.core.step_not_run(plan))
        self._after_step()

    async def on_worker_lost(self, msg: am.WorkerLost) -> None:
        self.worker_ready = False
        self.worker_state = "restarting"
        lost, self.in_flight = self.in_flight, None
        leaked = commands.unowned_references(self.core)
        if leaked:  # the pool is reset below, which would hide them from a later reconcile
            log.error("worker lost with KV blocks owned by no request",
                      blocks=[block for block, _ in leaked])
        requeued = self.core.requeue_all()
        self.core.grammars.reset()  # the next worker has built none
        failed = self._charge_lost_step(lost)
        log.warning("worker lost", reason=msg.reason, requeued=len(requeued), failed=len(failed))
        self._after_step()

    def _charge_lost_step(self, plan: StepPlan | None) -> list[str]:
        """The core bisects the lost step's requests and ends the one that kills the worker."""
        outputs = self.core.charge_lost_step(plan, self.max_step_losses)
        for out in outputs:
            log.error("request failed: its steps lost the worker",
                      request_id=clip(out.request_id, _LOG_LIMITS), losses=self.max_step_losses)
        self._emit_ended(outputs)
        return [out.request_id for out in outputs]

    async def on_worker_ready(self, msg: am.WorkerReady) -> None:
        self.worker_ready = True
        self.worker_state = "ready"
        self.worker_failure = ""
        self.worker_restarts = msg.restarts
        self.worker_pid = msg.pid
        self.worker_rank_pids = tuple(msg.rank_pids)
        self.worker_dtypes = (msg.dtype, msg.kv_dtype)
        self.core.grammars.reset()  # a new worker (this actor may not have seen the old go)
        self._maybe_step()

    async def on_worker_failed(self, msg: am.WorkerFailed) -> None:
        """No worker can start: end what waits for one with an error that says so."""
        self.worker_ready = False
        self.in_flight = None
        first = self.worker_state != "failed"
        self.worker_state = "failed"
        self.worker_failure = msg.reason
        self.worker_restarts = msg.restarts
        self.worker_pid = 0
        self.worker_rank_pids = ()
        rids = list(self.core.requests)
        why = worker_failed_message(msg.reason)  # what their clients' `Error` says
        self._emit_ended([out for rid in rids
                    if (out := self.core.abort(rid, m.FinishReason.ERROR, why)) is not None])
        if first or rids:
            log.error("worker failed: requests are refused until it recovers",
                      attempts=msg.attempts, reason=msg.reason, ended=len(rids))
        self._after_step()

    def _after_step(self) -> None:
        deferred, self.deferred = self.deferred, []
        for msg in deferred:
            self._apply_pause_or_resume(msg)
        waiting, self.between_steps = self.between_steps, []
        for check in waiting:  # one may start a step (reconcile does): the rest wait again
            self.between_steps_do(check)
        self._maybe_step()

    def between_steps_do(self, check: Callable[[], None]) -> None:
        """Run `check` now if no step is in flight, else right after the step in flight."""
        if self.in_flight is None:
            check()
        else:
            self.between_steps.append(check)

    def _maybe_step(self) -> None:
        while self.in_flight is None and self.worker_ready and self.core.has_unfinished():
            if self._downstream_busy():
                self.waiting_for_room = True  # the next Backlog with room steps again
                return
            core = self.core
            decodes = len(core.running) - len(core.prefilling)
            plan = core.schedule(self.step_budget.next(decodes * core.config.decode_weight))
            # with no sequence, a plan still goes while the worker builds grammars: it answers
            # once a build finished, or after a short wait
            if plan.seqs or plan.grammars or core.grammars.waiting:
                step_id = self._wire_step_id(plan)
                try:
                    frame = encode_plan(dataclasses.replace(plan, step_id=step_id))
                except Exception as exc:  # a request's values cannot reach the worker
                    self._drop_unsendable(plan, exc)
                    continue
                self.in_flight = plan
                self.step_sent = trio.current_time()
                self.executor.put(PlanFrame(step_id, frame))
                return
            # nothing to run (everything paused or waiting for KV); flush ended requests
            outputs = self.core.update(plan, StepResult(plan.step_id))
            self._emit(outputs)
            if not outputs:
                return

    def _drop_unsendable(self, plan: StepPlan, exc: Exception) -> None:
        """A plan that cannot be encoded for the worker did not run: the requests whose own
        share of it cannot be encoded end with an error (all of its requests, if none alone
        is the cause), and the rest are planned again."""
        def sendable(seq) -> bool:
            try:
                encode_plan(dataclasses.replace(plan, seqs=[seq]))
            except Exception:
                return False
            return True

        culprits = [s.request_id for s in plan.seqs if not sendable(s)]
        self._emit(self.core.step_not_run(plan))
        self._fail_requests(culprits or [s.request_id for s in plan.seqs], exc)

    def _fail_requests(self, rids: list[str], exc: Exception) -> None:
        """End requests whose own data made handling them raise: each with an error, its KV
        freed. Not a crash: the core was not left half-changed, and every other request goes
        on (a restart would end them all, and count toward the daemon's escalation)."""
        why = f"the request failed in the scheduler: {type(exc).__name__}"
        outputs = []
        for rid in rids:
            log.error("request failed in the scheduler", request_id=clip(rid, _LOG_LIMITS),
                      error=repr(exc))
            if rid in self.core.requests:
                out = self.core.abort(rid, m.FinishReason.ERROR, why)
            else:  # refused before the core took it: its end is told all the same
                out = RequestOutput(rid, [], finished=True, finish_reason=m.FinishReason.ERROR,
                                    error=why)
            if out is not None:
                outputs.append(out)
        self._emit_ended(outputs)

    def _emit(self, outputs: StepOutputs) -> None:
        """Tell the tokenizer `outputs`, after the admissions held for them."""
        admitted, self.admitted = self.admitted, []
        if not outputs and not admitted:
            return
        if outputs:
            self.latency.record(self.core, outputs)
            for out in outputs.outputs:
                if out.finished:
                    key = "cancelled" if out.finish_reason in _CANCELLED else "finished"
                    self.counters[key] += 1
        self.tokenizer.put(am.StepOutputs(outputs, tuple(admitted)))

    def _emit_ended(self, outputs: list[RequestOutput]) -> None:
        """`_emit` outputs that are not a step's (ends, mostly)."""
        self._emit(StepOutputs(outputs=outputs))

    # -- operations ---------------------------------------------------------------------------

    async def on_operate(self, msg: am.Operate) -> None:
        command = msg.command
        if isinstance(command, m.CancelCommand):
            reply, outputs = commands.cancel(self.core, command.request_id)
            if outputs:
                self._emit_ended(outputs)
                self._maybe_step()
        elif isinstance(command, m.DrainCommand):
            self.draining = True
            reply = m.CommandReply("drain", True, "draining: new requests are rejected")
        elif isinstance(command, m.ReconcileCommand):
            self.between_steps_do(lambda: self._answer_reconcile(msg))
            return
        elif isinstance(command, m.TenantSet):
            reply, outputs = commands.set_tenant(self.core, command)
            self._emit_ended(outputs)
            if reply.ok:  # new limits may let a waiting request in
                self._maybe_step()
        elif isinstance(command, m.InjectFault) and command.kind == "leak_block":
            reply = commands.leak_block(self.core)
        elif isinstance(command, m.InjectFault) and command.kind == "crash_scheduler":
            # answer first: the control actor must not wait for a reply that never comes
            self.askers.put(msg.reply_to, am.Reply(msg.token, m.CommandReply(
                "fault", True, "the scheduler crashes now")))
            raise RuntimeError("injected scheduler fault")
        elif isinstance(command, am.ReleaseAll):
            reply, outputs = commands.release_all(self.core)
            self._emit_ended(outputs)
        else:
            reply = m.CommandReply("unknown", False, f"the scheduler cannot do {command!r}")
        self.askers.put(msg.reply_to, am.Reply(msg.token, reply))

    def _answer_reconcile(self, msg: am.Operate) -> None:
        findings, outputs = commands.reconcile(self.core, msg.connections)
        self._emit_ended(outputs)
        self._maybe_step()
        self.askers.put(msg.reply_to, am.Reply(msg.token, commands.reconcile_reply(findings)))

    async def on_ask(self, msg: am.Ask) -> None:
        """Status for `sluice status` and the daemon, a snapshot for the console; the
        consistency check waits for the gap between two steps."""
        if isinstance(msg.query, m.Subscribe):
            answer = m.ControlSnapshot(0, self.report(), self.detail())
        elif isinstance(msg.query, MetricsQuery):
            answer = MetricsSnapshot(m.ControlSnapshot(0, self.report(), self.detail()),
                                     self.histograms())
        elif getattr(msg.query, "check_invariants", False):
            self.between_steps_do(lambda: self.askers.put(
                msg.reply_to, am.Reply(msg.token, am.Snapshot(self.report(check=True)))))
            return
        else:
            answer = am.Snapshot(self.report())
        self.askers.put(msg.reply_to, am.Reply(msg.token, answer))

    def report(self, *, check: bool = False) -> m.StatusReport:
        return commands.status_report(self.core, worker=self._worker_status(),
                                      counters=self.counters, draining=self.draining, check=check)

    def detail(self) -> m.ConsoleDetail:
        latency = commands.latency_summary(self.latency.summary(self.core.clock()))
        return commands.console_detail(self.core, latency=latency)

    def histograms(self) -> tuple[Histogram, ...]:
        return tuple(Histogram(kind, tenant, buckets.bounds, tuple(buckets.counts), buckets.total)
                     for (kind, tenant), buckets in self.latency.buckets.items())

    def _worker_status(self) -> m.WorkerStatus:
        return m.WorkerStatus(self.worker_state, self.worker_restarts, self.worker_pid,
                              self.worker_failure, *self.worker_dtypes, oom_steps=self.oom_steps,
                              rank_pids=self.worker_rank_pids)

    async def on_drain(self, msg: am.Drain) -> None:
        self.draining = True

    async def on_end_drain(self, msg: am.EndDrain) -> None:
        self.draining = False

    def close(self) -> None:
        super().close()
        self.askers.close()

    async def on_crash(self, exc: BaseException) -> None:
        rids = list(self.core.requests)
        self._emit_ended([RequestOutput(rid, [], finished=True, finish_reason=m.FinishReason.ERROR)
                    for rid in rids])
        log.error("scheduler lost its requests", count=len(rids))


def worker_failed_message(reason: str) -> str:
    return (f"the worker failed: it could not be started ({reason[:200]}); the daemon retries "
            "it on a long backoff, or at once on `sluice recover`")

