"""Helpers for driving the scheduler core without a model (imported by the tests here)."""

from __future__ import annotations

from sluice.actors.scheduler import Request, Scheduler, SchedulerConfig
from sluice.actors.scheduler.plan import ScheduledSeq, StepPlan, StepResult
from sluice.ipc.vocabulary import SamplingParams


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def prefill_plan(lengths: list[int], vocab: int, *, seed: int = 5,
                 block_size: int = 16) -> StepPlan:
    """One step prefilling a greedy sequence of each length whole (made-up token ids below
    `vocab`), each in its own run of pool blocks from block 0 on."""
    greedy = SamplingParams(temperature=0.0)
    seqs, block = [], 0
    for i, n in enumerate(lengths):
        blocks = -(-n // block_size)
        seqs.append(ScheduledSeq(f"r{i}", [(seed * (i + 1) + 3 * t) % vocab for t in range(n)],
                                 0, list(range(block, block + blocks)), True, greedy))
        block += blocks
    return StepPlan(1, seqs)


def sample_all(plan: StepPlan, token: int = 7) -> StepResult:
    """A result that samples `token` for every sequence the plan asks to sample."""
    return StepResult(
        plan.step_id, {s.request_id: token for s in plan.seqs if s.sample}
    )


def step(sched: Scheduler, token: int = 7, *, check: bool = True):
    """One step of `sched` sampling `token`: its plan, and its outputs one per request."""
    plan = sched.schedule()
    outputs = list(sched.update(plan, sample_all(plan, token)))
    if check:
        sched.check_invariants()
    return plan, outputs


def req(
    rid: str,
    prompt_len: int = 8,
    max_tokens: int = 4,
    *,
    tenant: str = "default",
    priority: int = 0,
    arrival: float | None = None,
    first: int = 1000,
    timeout: float | None = None,
    **sampling,
) -> Request:
    """A request whose prompt is `prompt_len` distinct tokens starting at `first`."""
    return Request(
        rid,
        list(range(first, first + prompt_len)),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling),
        tenant=tenant,
        priority=priority,
        arrival_time=arrival,
        timeout=timeout,
    )


def make_scheduler(clock: FakeClock | None = None, **settings) -> Scheduler:
    eos = settings.pop("eos_token_ids", frozenset())
    max_model_len = settings.pop("max_model_len", 2048)
    settings.setdefault("policy", "fcfs")
    return Scheduler(
        SchedulerConfig(**settings),
        eos_token_ids=eos,
        max_model_len=max_model_len,
        clock=clock or FakeClock(),
    )
