"""A higher-priority arrival takes the running place of a lower one on the real model, and
both end with the greedy tokens each gives alone (float32): the preempted one recomputes."""

from __future__ import annotations

import pytest

from sluice.ipc.vocabulary import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.slow
def test_a_high_priority_arrival_preempts_and_both_outputs_are_right(make_engine,
                                                                     smollm_tokenizer):
    low_ids = smollm_tokenizer.encode("The history of the printing press begins")
    high_ids = smollm_tokenizer.encode("A short list of rivers in Europe:")
    alone = make_engine(num_blocks=64, policy="priority", max_running=1)
    expected = {name: completion.token_ids for name, completion in
                zip(("low", "high"), alone.generate([low_ids, high_ids], GREEDY))}

    engine = make_engine(num_blocks=64, policy="priority", max_running=1)
    engine.add_request(prompt_token_ids=low_ids, sampling=GREEDY, request_id="low")
    tokens = {"low": [], "high": []}
    reasons = {}

    def step() -> list[str]:
        ran = []
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            ran.append(out.request_id)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        return ran

    for _ in range(5):  # its prefill and a few decodes
        step()
    assert 0 < len(tokens["low"]) < 12
    engine.add_request(prompt_token_ids=high_ids, sampling=GREEDY, request_id="high",
                       priority=5)
    assert step() == ["high"]  # it took the one running place at once
    while len(reasons) < 2:
        step()
    assert reasons == {"low": "length", "high": "length"}
    assert tokens == expected
    low = engine.scheduler.get_request("low")
    assert (low.num_preemptions, low.num_priority_preemptions) == (1, 1)
