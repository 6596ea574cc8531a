"""The null executor: an explicitly fake, zero-cost model for `--executor null`.

It answers every step plan at once with tokens from a fixed cycle (never EOS), so requests
end by length. It exists to measure what the daemon itself costs per token (sockets, actors,
scheduling, detokenizing, streaming); its output means nothing. It stands in for the worker
process and speaks its protocol: it reads each plan's bytes and answers with a result's bytes
in the worker's encoding, so the Scheduler's side of a step is the same with either executor.
It reads and writes their compact forms without building the plan's and result's objects:
that work is the worker process's, and charging it to the daemon would overstate what
serving costs. Asked for the worker's state (`WorkerQuery`) it answers with the facts it was
configured with. The test fault `InjectOutOfMemory` makes it answer the next plan as a
worker out of memory would.
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.actors.runtime import messages as am
from sluice.actors.runtime.base import Actor, Handler, Outbox, Outboxes
from sluice.actors.executor.protocol import (
    InjectOutOfMemory, PlanFrame, ResultFrame, StepOutOfMemory,
)  # fmt: skip
from sluice.actors.runtime.registry import CODEC
from sluice.actors.runtime.reports import WorkerFacts, WorkerQuery, WorkerState
from sluice.actors.scheduler.plan import StepPlan, StepResult
from sluice.ipc.vocabulary import SamplingParams


class NullExecutor(Actor):
    name = "executor"

    def __init__(self, *, scheduler: Outbox, token_cycle: Sequence[int],
                 facts: WorkerFacts | None = None):
        super().__init__()
        if not token_cycle:
            raise ValueError("token_cycle must not be empty")
        self.scheduler = scheduler
        self.facts = facts
        self.askers = Outboxes()  # whoever asked for the worker's state (the daemon at boot)
        self.token_cycle = tuple(token_cycle)
        self.restarts = -1
        self.state = "null"
        self.out_of_memory_next = False

    def reset(self) -> None:
        self.restarts += 1
        self.scheduler.put(am.WorkerReady(self.restarts))

    def handlers(self) -> dict[type, Handler]:
        return {PlanFrame: self.on_plan, am.AskWorker: self.on_ask_worker,
                am.Recover: self.on_recover, am.Ask: self.on_ask,
                InjectOutOfMemory: self.on_inject_out_of_memory}

    async def on_ask(self, msg: am.Ask) -> None:
        if isinstance(msg.query, WorkerQuery):
            self.askers.put(msg.reply_to, am.Reply(msg.token, WorkerState(self.state, self.facts)))

    def close(self) -> None:
        super().close()
        self.askers.close()

    async def on_ask_worker(self, msg: am.AskWorker) -> None:
        self.scheduler.put(am.WorkerReady(self.restarts))  # a fake worker is always ready

    async def on_recover(self, msg: am.Recover) -> None:
        """A fake worker has nothing to restart: count it and say it is ready again."""
        self.restarts += 1
        self.scheduler.put(am.WorkerReady(self.restarts))

    async def on_inject_out_of_memory(self, msg: InjectOutOfMemory) -> None:
        self.out_of_memory_next = True

    async def on_plan(self, frame: PlanFrame) -> None:
        # the compact forms of `StepPlan.to_plain` and `StepResult.to_plain`
        step_id, samplings, seqs, grammars = CODEC.decode_compact(frame.frame, StepPlan)
        if self.out_of_memory_next:
            self.out_of_memory_next = False
            self.scheduler.put(StepOutOfMemory(step_id, "test fault: out of memory"))
            return
        cycle, period = self.token_cycle, len(self.token_cycle)
        asks = [SamplingParams.from_plain(params).logprobs for params in samplings]
        # each seq: [rid, tokens, start, table, sample, params, generated, ...]
        sampling = [seq for seq in seqs if seq[4]]
        tokens = [cycle[seq[6] % period] for seq in sampling]
        detailed = None
        if any(ask is not None for ask in asks):
            detailed = {seq[0]: _certain(token, asks[seq[5]])
                        for seq, token in zip(sampling, tokens) if asks[seq[5]] is not None}
        # it samples no grammar: each is built as soon as it is asked for
        plain = [step_id, [seq[0] for seq in sampling], tokens, detailed or None, 0.0,
                 [grammar[0] for grammar in grammars]]
        self.scheduler.put(ResultFrame(CODEC.encode_compact(StepResult, plain)))

    async def on_crash(self, exc: BaseException) -> None:
        self.scheduler.put(am.WorkerLost(f"null executor crashed: {type(exc).__name__}"))


def _certain(token_id: int, logprobs: int) -> list:
    """The full form of the cycle's next token for a request that asked for logprobs: certain,
    so its logprob is 0 and it is its only alternative."""
    return [token_id, 0.0, [(token_id, 0.0)] if logprobs else None]
