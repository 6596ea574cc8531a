"""bfloat16 is selectable end to end: weights, KV pool and a sensible answer."""

from __future__ import annotations

import torch

from sluice.actors.engine import Engine
from sluice.actors.scheduler.plan import SamplingParams


def test_bfloat16_engine_answers_the_capital_question(smollm_tokenizer):
    engine = Engine(dtype="bfloat16", num_blocks=64, tokenizer=smollm_tokenizer)
    assert engine.runner.model.embed.dtype == torch.bfloat16
    assert engine.runner.kv_pool[0][0].dtype == torch.bfloat16
    [answer] = engine.generate([[{"role": "user", "content": "What is the capital of France?"}]],
                               SamplingParams(max_tokens=12, temperature=0.0), chat=True)
    assert "Paris" in answer.text
    engine.scheduler.check_invariants()
