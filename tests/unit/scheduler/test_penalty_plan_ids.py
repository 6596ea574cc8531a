"""A request with penalties does not send its ids with every step: the worker keeps them
(`sampler.PenaltyIds`) and a decode's plan carries its last output id only; its prompt and
whole output travel where the worker may lack them (its first sampling step, a recompute
after a preemption or a lost worker, a request not planned for longer than `MATCHER_STEPS`).
Driven by the core's plans, the worker's lists are the request's own at every step, across a
preemption, a long pause and a worker replaced mid-output, so the penalties see what they saw
when every plan carried everything."""

from __future__ import annotations

import pytest
from support.scheduler import make_scheduler, req

from sluice.actors.executor.sampler import PenaltyIds
from sluice.actors.scheduler.plan import MATCHER_STEPS, StepResult

REPETITION = {"repetition_penalty": 1.3}
COUNTS = {"frequency_penalty": 0.5, "presence_penalty": 0.25}


def seq_of(plan, rid: str):
    found = [s for s in plan.seqs if s.request_id == rid]
    return found[0] if found else None


def test_a_long_penalized_output_carries_one_id_per_decode() -> None:
    sched = make_scheduler(block_size=16, kv_blocks=256, token_budget=64)
    sched.add_request(req("rep", prompt_len=100, max_tokens=600, **REPETITION))
    sched.add_request(req("counts", prompt_len=8, max_tokens=600, first=3000, **COUNTS))
    sched.add_request(req("free", prompt_len=8, max_tokens=600, first=2000))
    sizes, prompts = [], []
    for n in range(300):
        plan = sched.schedule()
        seq = seq_of(plan, "rep")
        if seq.sample:
            sizes.append(len(seq.output_token_ids))
            prompts.append(seq.prompt_token_ids)
        else:  # a prefill chunk that does not sample carries nothing
            assert seq.output_token_ids is None and seq.prompt_token_ids is None
        assert seq_of(plan, "free").output_token_ids is None
        assert seq_of(plan, "counts").prompt_token_ids is None  # no repetition penalty
        sched.update(plan, StepResult(plan.step_id, {s.request_id: 100 + n % 7
                                                     for s in plan.seqs if s.sample}))
        sched.check_invariants()
    request = sched.get_request("rep")
    assert sizes[0] == 0 and set(sizes[1:]) == {1}
    assert prompts[0] == request.prompt_token_ids and not any(prompts[1:])

    sched.preempt(request)  # recomputed: the worker's ids are sent again, all of them
    while (seq := seq_of(plan := sched.schedule(), "rep")) is None or not seq.sample:
        sched.update(plan, StepResult(plan.step_id, {s.request_id: 5
                                                     for s in plan.seqs if s.sample}))
    assert seq.output_token_ids == request.output_token_ids
    assert seq.prompt_token_ids == request.prompt_token_ids


def test_the_worker_keeps_each_request_s_ids_as_the_core_has_them() -> None:
    """The core's plans drive a worker's `PenaltyIds` through a preemption, a pause past
    `MATCHER_STEPS` (the worker drops the idle request's ids meanwhile) and a worker lost (a
    new one takes the recompute's full ids); at every step each penalized sequence it fills
    holds its request's whole prompt and output."""
    worker = PenaltyIds()
    sched = make_scheduler(block_size=16, kv_blocks=256)
    sched.add_request(req("a", prompt_len=20, max_tokens=300, **REPETITION))
    sched.add_request(req("b", prompt_len=8, max_tokens=300, first=2000, **REPETITION, **COUNTS))
    sched.add_request(req("c", prompt_len=8, max_tokens=300, first=4000, **COUNTS))
    sched.add_request(req("other", prompt_len=8, max_tokens=10_000, first=3000))
    checked = 0

    def step() -> None:
        nonlocal checked
        plan = sched.schedule()
        seqs = [s for s in plan.seqs if s.sample]
        worker.fill(seqs)
        for seq in seqs:
            request = sched.get_request(seq.request_id)
            if request.has_penalties:
                assert seq.output_token_ids == request.output_token_ids, seq.request_id
                if request.sampling.repetition_penalty != 1.0:
                    assert seq.prompt_token_ids == request.prompt_token_ids
                checked += 1
        sched.update(plan, StepResult(plan.step_id, {s.request_id: 7 + plan.step_id % 50
                                                     for s in seqs}))
        sched.check_invariants()

    for _ in range(40):
        step()
    sched.preempt(sched.get_request("a"))
    for _ in range(10):
        step()
    sched.pause("b")
    for _ in range(2 * MATCHER_STEPS + 20):  # the others alone: the worker drops b's ids
        step()
    assert "b" not in worker._ids
    sched.resume("b")
    for _ in range(10):
        step()
    sched.requeue_all()  # the worker is lost: a new one knows no request
    worker = PenaltyIds()
    for _ in range(40):
        step()
    assert checked > 250
    assert len(sched.get_request("b").output_token_ids) >= 40


def test_a_worker_without_the_ids_and_only_the_last_one_says_so() -> None:
    sched = make_scheduler(block_size=16, kv_blocks=64)
    sched.add_request(req("a", prompt_len=8, max_tokens=50, **REPETITION))
    for _ in range(3):
        plan = sched.schedule()
        sched.update(plan, StepResult(plan.step_id, {"a": 28}))
    plan = sched.schedule()
    assert seq_of(plan, "a").output_token_ids == [28]
    with pytest.raises(ValueError, match="no prompt ids"):
        PenaltyIds().fill(plan.seqs)
    counts = make_scheduler(block_size=16, kv_blocks=64)
    counts.add_request(req("c", prompt_len=8, max_tokens=50, **COUNTS))
    for _ in range(3):
        plan = counts.schedule()
        counts.update(plan, StepResult(plan.step_id, {"c": 28}))
    with pytest.raises(ValueError, match="from token 2, and this worker has 0"):
        PenaltyIds().fill(counts.schedule().seqs)
