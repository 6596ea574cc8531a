"""The plan builder: the state of one planning iteration, from the first pick to the `StepPlan`.

The scheduler makes one per `schedule()` call and drops it when the plan is built. It holds
the sequences chosen so far, the token budget they have left (`w_p * prefill_tokens + w_d *
decode_tokens <= C`), the group of suspects this step is limited to (see `bisection.py`) and
the preemption count at the start of the step. When a request planned earlier in the same
iteration loses its KV (it was preempted to make room for another), `undo` takes its sequence
out and gives its budget back. Which requests get planned, and every change of their state,
is the scheduler's (`scheduler.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from sluice.actors.scheduler.config import SchedulerConfig
from sluice.actors.scheduler.plan import MATCHER_STEPS, ScheduledSeq, StepPlan
from sluice.actors.scheduler.policy import preemption_key
from sluice.actors.scheduler.request import Request


class PlanBuilder:
    def __init__(
        self,
        step_id: int,
        config: SchedulerConfig,
        clock: Callable[[], float],
        *,
        probe: frozenset[str] | None,
        preemptions: int,
        token_budget: float | None = None,
    ):
        self.step_id = step_id
        # the configured budget, unless this step gets less (see `step_budget.py`)
        self.token_budget = config.token_budget if token_budget is None else token_budget
        self.budget = float(self.token_budget)
        self.prefill_weight = config.prefill_weight
        self.decode_weight = config.decode_weight
        self.first_token_from_prefill = config.first_token_from_prefill
        self.clock = clock
        self.probe = probe  # the suspects this plan is limited to, None for everyone
        self.preemptions_at_start = preemptions
        self.seqs: dict[str, ScheduledSeq] = {}
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self._held_back = 0.0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.seqs

    @property
    def can_prefill(self) -> bool:
        return self.budget >= self.prefill_weight

    @property
    def prefill_room(self) -> int:
        """Prompt tokens the budget has left."""
        return int(self.budget // self.prefill_weight)

    def may_plan(self, request: Request, suspects: Collection[str]) -> bool:
        """While a suspect group is probed only its members run; else everyone but suspects."""
        if self.probe is not None:
            return request.request_id in self.probe
        return not suspects or request.request_id not in suspects

    def first_queued_suspect(self, live: Mapping[str, Request]) -> Request | None:
        """The queued member of the probed group that arrived first."""
        members = (live.get(rid) for rid in self.probe or ())
        queued = [r for r in members if r is not None and r.in_queue]
        return min(queued, key=preemption_key, default=None)

    def hold_back(self, amount: float) -> None:
        """Keep `amount` of the budget from what is planned until `release`."""
        self._held_back += amount
        self.budget -= amount

    def release(self) -> None:
        self.budget += self._held_back
        self._held_back = 0.0

    def add_prefill(self, request: Request, start: int, n: int) -> None:
        """Plan prompt (or recomputed) tokens `start:start+n` and charge them to the budget."""
        tokens = request.all_token_ids
        end = start + n
        sample = end >= len(tokens) and (self.first_token_from_prefill
                                         or bool(request.output_token_ids))
        self._place(request, tokens[start:end], start, sample, decode=False)
        self.budget -= self.prefill_weight * n
        self.prefill_tokens += n

    def add_decode(self, request: Request, start: int) -> None:
        """Plan the one token at `start` of a decoding request (sampled when it is the last)."""
        tokens = request.all_token_ids
        self._place(request, tokens[start:start + 1], start, start + 1 >= len(tokens),
                    decode=True)
        self.budget -= self.decode_weight
        self.decode_tokens += 1

    def _place(self, request: Request, token_ids: list[int], start: int, sample: bool, *,
               decode: bool) -> None:
        outputs = request.output_token_ids
        prompt = carried = None
        if sample and (request.has_penalties or request.sampling.constrained):
            # the worker keeps a request's ids (its grammar matcher, its penalties' ids) and
            # takes the ones it lacks from the end of the output (see `plan.MATCHER_STEPS`)
            recent = 0 <= request.scheduled_step and (
                self.step_id - request.scheduled_step <= MATCHER_STEPS)
            if decode and recent and outputs:
                carried = outputs[-1:]
            else:
                carried = list(outputs)
                if request.sampling.repetition_penalty != 1.0:
                    prompt = request.prompt_token_ids
        self.seqs[request.request_id] = ScheduledSeq(
            request.request_id, token_ids, start, request.block_ids, sample, request.sampling,
            len(outputs), request.sampling_seed, prompt, carried,
        )
        request.scheduled_step = self.step_id
        request.last_chunk_was_decode = decode
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()

    def undo(self, request: Request) -> None:
        """The request lost its KV while this plan was built: take it out, give its budget back."""
        seq = self.seqs.pop(request.request_id, None)
        if seq is None:
            return
        if request.last_chunk_was_decode:
            self.budget += self.decode_weight
            self.decode_tokens -= 1
        else:
            self.budget += self.prefill_weight * len(seq.token_ids)
            self.prefill_tokens -= len(seq.token_ids)

    def build(self) -> StepPlan:
        return StepPlan(step_id=self.step_id, seqs=list(self.seqs.values()))

    def composition(self) -> dict[str, float]:
        """What the plan holds and how much of the budget it used, for snapshots."""
        return {
            "seqs": len(self.seqs),
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "budget_used": self.token_budget - self.budget,
            "token_budget": self.token_budget,
        }
