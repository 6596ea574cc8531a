"""The in-process engine plans again smaller after a step that ran out of memory, as the
daemon does, and its outputs stay the greedy ones (float32)."""

from __future__ import annotations

import pytest
import torch

from sluice.ipc.vocabulary import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = ["The history of the printing press begins", "A short list of rivers in Europe:"]


@pytest.mark.slow
def test_a_step_out_of_memory_is_planned_again_smaller(make_engine, smollm_tokenizer):
    prompts = [smollm_tokenizer.encode(p) for p in PROMPTS]
    expected = [c.token_ids for c in make_engine(num_blocks=64).generate(prompts, GREEDY)]

    engine = make_engine(num_blocks=64)
    configured = engine.step_budget.configured
    engine.runner.inject_out_of_memory()  # the next forward raises torch.OutOfMemoryError
    halved = []  # the budgets the step that ran out of memory was planned with
    out_of_memory = engine.step_budget.out_of_memory

    def recorded(used=None):
        halved.append(engine.step_budget.planned)
        return out_of_memory(used)

    engine.step_budget.out_of_memory = recorded
    completions = engine.generate(prompts, GREEDY)
    assert halved == [configured], "the injected fault fired once, in a full-budget step"
    assert [c.token_ids for c in completions] == expected
    assert [c.finish_reason for c in completions] == ["length", "length"]
    assert engine.step_budget.limit == configured  # doubled back as steps ran
    assert engine.scheduler.kv_cache.num_used_blocks == 0
    engine.scheduler.check_invariants()


@pytest.mark.slow
def test_out_of_memory_at_the_smallest_step_is_raised(make_engine, smollm_tokenizer):
    engine = make_engine(num_blocks=64)
    engine.add_request(prompt_token_ids=smollm_tokenizer.encode(PROMPTS[0]), sampling=GREEDY)
    budget = engine.step_budget
    budget.limit = budget.minimum  # as after halvings
    engine.runner.inject_out_of_memory()
    with pytest.raises(torch.OutOfMemoryError):
        while True:
            engine.step()
    # the step was undone: the request waits as before it, and can still run
    engine.scheduler.check_invariants()
    assert engine.scheduler.kv_cache.num_used_blocks == 0
    completion = engine.generate([smollm_tokenizer.encode(PROMPTS[1])], GREEDY)[0]
    assert completion.finish_reason == "length"
