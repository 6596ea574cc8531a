"""The null executor: an explicitly fake, zero-cost model for `--executor null`.

It answers every `StepPlan` at once with tokens from a fixed cycle (never EOS), so requests
end by length. It exists to measure what the daemon itself costs per token (sockets, actors,
scheduling, detokenizing, streaming); its output means nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.actors.base import Actor, Handler, Outbox
from sluice.actors.scheduler.plan import SampledToken, StepPlan, StepResult
from sluice.ipc import messages as m


class NullExecutor(Actor):
    name = "executor"

    def __init__(self, *, scheduler: Outbox, token_cycle: Sequence[int]):
        super().__init__()
        if not token_cycle:
            raise ValueError("token_cycle must not be empty")
        self.scheduler = scheduler
        self.token_cycle = tuple(token_cycle)
        self.restarts = -1
        self.state = "null"

    def reset(self) -> None:
        self.restarts += 1
        self.scheduler.put(m.WorkerReady(self.restarts))

    def handlers(self) -> dict[type, Handler]:
        return {StepPlan: self.on_plan, m.AskWorker: self.on_ask_worker,
                m.Recover: self.on_recover}

    async def on_ask_worker(self, msg: m.AskWorker) -> None:
        self.scheduler.put(m.WorkerReady(self.restarts))  # a fake worker is always ready

    async def on_recover(self, msg: m.Recover) -> None:
        """A fake worker has nothing to restart: count it and say it is ready again."""
        self.restarts += 1
        self.scheduler.put(m.WorkerReady(self.restarts))

    async def on_plan(self, plan: StepPlan) -> None:
        cycle = self.token_cycle
        sampled = {
            seq.request_id: SampledToken(cycle[seq.num_generated % len(cycle)])
            for seq in plan.seqs
            if seq.sample
        }
        self.scheduler.put(StepResult(plan.step_id, sampled))

    async def on_crash(self, exc: BaseException) -> None:
        self.scheduler.put(m.WorkerLost(f"null executor crashed: {type(exc).__name__}"))
