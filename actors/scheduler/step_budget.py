"""The token budget of the next step, after steps the worker ran out of memory in.

A step that ran out of memory did not happen (`Scheduler.step_not_run`); the next plans get
half of what the failed one used of its budget, and every step that runs doubles that back,
up to the configured `token_budget`. It never goes under what one decode token of every running
request needs, nor under a minimum chunk: a step that runs out of memory at that size
cannot be made smaller, and `out_of_memory` says so — the caller then treats the worker
as failed. Which requests fill the budget is the scheduler's.
"""

from __future__ import annotations

from sluice.actors.scheduler.config import SchedulerConfig

MIN_CHUNK = 16  # prompt tokens: the smallest prefill chunk worth a step of its own


class StepBudget:
    def __init__(self, configured: float, minimum: float):
        self.configured = configured
        self.minimum = min(minimum, configured)
        self.limit = configured  # what the next plan may take, before its floor
        self.planned = configured  # the budget of the latest plan
        self.smallest = self.minimum  # the least that plan could have had

    @classmethod
    def for_config(cls, config: SchedulerConfig) -> StepBudget:
        return cls(config.token_budget, max(config.decode_weight,
                                            config.prefill_weight * MIN_CHUNK))

    @property
    def reduced(self) -> bool:
        return self.limit < self.configured

    def next(self, decodes_weight: float = 0.0) -> float:
        """The budget of the next plan; `decodes_weight` is what one decode token of every
        running request costs, a floor that a halving never takes away."""
        self.smallest = max(self.minimum, min(decodes_weight, self.configured))
        self.planned = max(self.limit, self.smallest)
        return self.planned

    def out_of_memory(self, used: float | None = None) -> bool:
        """The latest plan ran out of memory having used `used` of its budget (None: all of
        it): the next plans get half that. False when it had the smallest budget already: a
        smaller step is not possible."""
        if self.planned <= self.smallest:
            return False
        used = self.planned if used is None else min(used, self.planned)
        self.limit = max(used / 2, self.minimum)
        return True

    def step_ran(self) -> None:
        self.limit = min(self.limit * 2, self.configured)
