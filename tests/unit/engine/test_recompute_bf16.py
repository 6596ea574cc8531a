"""The worker-crash promise in bfloat16: greedy requests recomputed on a fresh KV pool give the
uninterrupted tokens up to the first near tie (in float32 they are identical throughout,
see test_seeded_recompute.py and the e2e worker-kill test)."""

from __future__ import annotations

import pytest
import torch
from support.near_ties import assert_equal_until_near_tie, teacher_forced_top2

from sluice.actors.engine import Engine
from sluice.ipc.vocabulary import SamplingParams

PROMPTS = ["The capital of France is", "List three prime numbers: 2, 3,",
           "Once upon a time, in a small village by the sea,", "def add(a, b):\n"]


@pytest.mark.slow
def test_bf16_greedy_survives_a_lost_kv_pool_up_to_the_first_near_tie(smollm_tokenizer):
    engine = Engine(dtype="bfloat16", num_blocks=64, tokenizer=smollm_tokenizer)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [smollm_tokenizer.encode(p) for p in PROMPTS]
    expected = engine.generate(prompts, greedy)

    request_ids = [engine.add_request(prompt_token_ids=p, sampling=greedy) for p in prompts]
    for _ in range(5):
        engine.step()
    engine.scheduler.requeue_all()  # what the daemon does when its worker dies
    engine.runner.reset_kv()
    while engine.has_unfinished():
        engine.step()

    compared, recomputed = 0, 0
    for prompt, request_id, reference in zip(prompts, request_ids, expected):
        got = engine.scheduler.get_request(request_id)
        recomputed += got.num_recomputed_tokens
        top2 = teacher_forced_top2(engine.runner, prompt, reference.token_ids)
        compared += assert_equal_until_near_tie(got.output_token_ids, reference.token_ids, top2,
                                                torch.bfloat16)
    assert recomputed > 0
    # near ties (margins within 2 bf16 units in the last place) come every few tokens with
    # this model, so the comparison stops early; it must still cover some real ground
    assert compared >= 12
    engine.scheduler.check_invariants()
