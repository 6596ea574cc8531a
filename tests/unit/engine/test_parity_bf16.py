"""bfloat16 greedy output equals transformers' bfloat16 greedy output on the same GGUF
weights, up to the first position where transformers' own top-2 margin is a near tie."""

from __future__ import annotations

import pytest
import torch
from near_ties import assert_equal_until_near_tie, top2_margins

from sluice.actors.engine import Engine
from sluice.actors.scheduler.plan import SamplingParams

NEW_TOKENS = 48
# Near ties are common for this model in bf16: its top logits (~15-20) sit where bf16 numbers
# are 0.06-0.125 apart, and about one position in six has a top-2 margin of at most 2 units
# in the last place, so few prompts run 32 tokens before one (one run compared
# 12, 3, 22, 1, 3, 3, ... tokens). The test asks for real ground, not that.
LONG_ENOUGH = 8

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three prime numbers: 2, 3,",
    "Water boils at 100 degrees Celsius at sea level. At the top of a high mountain",
    "The three primary colors are",
    "import numpy as np\n\ndef mean(values):\n",
    "In 1969, the first humans walked on",
]


@pytest.fixture(scope="module")
def hf_bf16(smollm_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm_path.parent), gguf_file=smollm_path.name, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None  # all tokens, as ignore_eos does
    model.generation_config.pad_token_id = 0
    return model.eval()


def hf_greedy_with_margins(model, prompt_ids: list[int]):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    return out.sequences[0, len(prompt_ids):].tolist(), top2_margins(out.logits)


@pytest.mark.slow
def test_bf16_greedy_tokens_match_transformers_bf16_until_a_near_tie(
        smollm_path, smollm_tokenizer, hf_bf16):
    engine = Engine(dtype="bfloat16", num_blocks=256, tokenizer=smollm_tokenizer)
    assert engine.runner.model.dtype == torch.bfloat16
    prompts = [smollm_tokenizer.encode(p) for p in PROMPTS]
    ours = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                   ignore_eos=True))
    compared = []
    for prompt, completion in zip(prompts, ours):
        reference, top2 = hf_greedy_with_margins(hf_bf16, prompt)
        compared.append(assert_equal_until_near_tie(completion.token_ids, reference, top2,
                                                    torch.bfloat16))
    assert sum(n >= LONG_ENOUGH for n in compared) >= 2, compared
    engine.scheduler.check_invariants()
