"""After a step runs out of memory: the budget halves, then doubles back with each step that
runs; a step at the smallest budget cannot be made smaller; and the core forgets the step
that did not run, so planning it again smaller computes the same tokens."""

from __future__ import annotations

from support.scheduler import req, step

from sluice.actors.scheduler import SchedulerConfig
from sluice.actors.scheduler.plan import StepPlan, StepResult
from sluice.actors.scheduler.step_budget import MIN_CHUNK, StepBudget


def by_position(plan: StepPlan) -> StepResult:
    """A model whose next token depends only on the request and how far it got."""
    return StepResult(plan.step_id, {
        s.request_id: int(s.request_id[1:]) * 100 + s.num_generated
        for s in plan.seqs if s.sample})


def test_the_budget_halves_per_step_out_of_memory_and_doubles_back_per_step_that_ran():
    budget = StepBudget(512, 16)
    assert budget.next() == 512
    assert budget.out_of_memory()
    assert budget.next() == 256
    assert budget.out_of_memory()
    assert budget.next() == 128 and budget.reduced
    budget.step_ran()
    assert budget.next() == 256
    assert budget.out_of_memory(used=100)  # half of what the failed step took
    assert budget.next() == 50
    budget.step_ran()
    assert budget.next() == 100
    budget.step_ran()
    budget.step_ran()
    budget.step_ran()
    assert budget.next() == 512 and not budget.reduced  # never past the configured one


def test_a_step_at_the_smallest_budget_cannot_be_made_smaller():
    budget = StepBudget.for_config(SchedulerConfig(token_budget=64))
    sizes = []
    while budget.out_of_memory():
        sizes.append(budget.next())
    assert sizes == [32, 16] and budget.next() == MIN_CHUNK
    assert not budget.out_of_memory()


def test_one_decode_token_per_running_request_is_a_floor_no_halving_takes_away():
    budget = StepBudget(512, 16)
    assert budget.next(decodes_weight=300) == 512
    assert budget.out_of_memory()
    assert budget.next(decodes_weight=300) == 300  # not 256: every decode keeps its token
    assert not budget.out_of_memory()  # that step was as small as it could be
    assert budget.next(decodes_weight=1000) == 512  # the floor stops at the configured budget


def test_a_step_not_run_is_planned_again_from_the_same_tokens_and_ends_the_same(make_sched):
    def run(out_of_memory_at: int | None) -> dict[str, list[int]]:
        sched = make_sched(token_budget=64, max_prefill_chunk=64, kv_blocks=64)
        for i in range(3):
            sched.add_request(req(f"r{i}", prompt_len=40, max_tokens=5, first=100 * i))
        budget = StepBudget.for_config(sched.config)
        tokens: dict[str, list[int]] = {}
        steps = 0
        while sched.has_unfinished():
            steps += 1
            plan = sched.schedule(budget.next(len(sched.running) - len(sched.prefilling)))
            if steps == out_of_memory_at:
                computed = {rid: r.num_computed_tokens for rid, r in sched.requests.items()}
                assert not sched.step_not_run(plan) and budget.out_of_memory(plan.num_tokens)
                sched.check_invariants()
                assert computed == {rid: r.num_computed_tokens
                                    for rid, r in sched.requests.items()}
                smaller = sched.schedule(budget.next())
                assert smaller.num_tokens <= max(plan.num_tokens // 2, MIN_CHUNK)
                assert [(s.request_id, s.start_pos) for s in smaller.seqs] == [
                    (s.request_id, s.start_pos) for s in plan.seqs][:len(smaller.seqs)]
                plan = smaller
            for out in sched.update(plan, by_position(plan)):
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            budget.step_ran()
            sched.check_invariants()
        return tokens

    plain = run(None)
    assert {rid: len(ids) for rid, ids in plain.items()} == {"r0": 5, "r1": 5, "r2": 5}
    for at in (1, 2, 3, 5):  # prefill chunks, then decodes
        assert run(at) == plain


def test_a_decode_step_not_run_is_planned_again_the_same(make_sched):
    sched = make_sched()
    sched.add_request(req("a", prompt_len=8, max_tokens=2))
    plan, _ = step(sched)
    assert plan.seqs
    plan = sched.schedule()
    assert not sched.step_not_run(plan)
    sched.check_invariants()
    again = sched.schedule()
    assert [(s.request_id, s.start_pos, s.token_ids) for s in again.seqs] == [
        (s.request_id, s.start_pos, s.token_ids) for s in plan.seqs]
