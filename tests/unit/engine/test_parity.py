"""Greedy output equals Hugging Face transformers' on the same GGUF weights.

transformers checks each of sluice's tokens in one forward over prompt + output: its greedy
choice at every position must be sluice's token (`hf_teacher_forced`), which holds exactly
when sluice's run is transformers' greedy run."""

from __future__ import annotations

import pytest
import torch
from support.near_ties import hf_teacher_forced

from sluice.ipc.vocabulary import SamplingParams

NEW_TOKENS = 64

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who "
    "every morning walked down to the harbour before sunrise. One day he found",
    "List three prime numbers: 2, 3,",
    "Water boils at 100 degrees Celsius at sea level. At the top of a high mountain the air "
    "pressure is lower, so water boils at a lower temperature. This is why cooking pasta in "
    "the mountains takes longer, because the water is not as hot as it would be at sea level. "
    "Mountaineers have long known this, and many of them carry pressure cookers, which raise the "
    "boiling point again by sealing the pot. In the same way, a car's cooling system is kept "
    "under pressure so that",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of Japan?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue? Explain it like I am ten years old, "
                                 "and mention the sun and the air."}],
]


@pytest.fixture(scope="module")
def hf_model(smollm_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm_path.parent), gguf_file=smollm_path.name, dtype=torch.float32)
    return model.eval()


@pytest.mark.slow
def test_greedy_tokens_match_transformers(make_engine, smollm_tokenizer, hf_model):
    prompts = [smollm_tokenizer.encode(p) for p in RAW_PROMPTS]
    prompts += [smollm_tokenizer.encode_chat(c) for c in CHATS]
    lengths = [len(p) for p in prompts]
    assert any(n > 3 * 16 for n in lengths) and any(n % 16 for n in lengths)

    engine = make_engine(max_prefill_chunk=32)  # long prompts also cross chunk boundaries
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ours = engine.generate(prompts, greedy)

    for prompt, completion in zip(prompts, ours):
        assert completion.finish_reason == "length"
        choices, _ = hf_teacher_forced(hf_model, prompt, completion.token_ids)
        assert completion.token_ids == choices, smollm_tokenizer.decode(prompt)
