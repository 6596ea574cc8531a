"""Seeded sampling survives recomputation: after a preemption, and after the KV pool is lost as
in a worker restart, a seeded request draws the tokens it draws uninterrupted (float32)."""

from __future__ import annotations

import pytest

from sluice.ipc.vocabulary import SamplingParams

TEXT = ("A paged KV cache stores keys and values in fixed-size blocks, so a scheduler can hand "
        "the memory of a finished request to a new one at once and share common prefixes. ")
SETTINGS = [
    SamplingParams(max_tokens=14, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=1.0, top_k=20, seed=12, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=0.7, min_p=0.05, seed=13, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=1.2, seed=14, ignore_eos=True,
                   repetition_penalty=1.2),
]


def prompts(tokenizer) -> list[list[int]]:
    words = TEXT.split()
    return [tokenizer.encode(" ".join(words[i: i + 10 + 2 * i])) for i in range(len(SETTINGS))]


@pytest.mark.slow
def test_seeded_tokens_survive_preemption(make_engine, smollm_tokenizer):
    ids = prompts(smollm_tokenizer)
    expected = make_engine(num_blocks=64).generate(ids, SETTINGS)
    # 5 blocks of 16 tokens cannot hold four requests of ~25-40 tokens each
    tight = make_engine(num_blocks=5, enable_prefix_caching=False, kv_high_watermark=1.0,
                        kv_low_watermark=1.0, policy="fcfs")
    got = tight.generate(ids, SETTINGS)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert sum(c.usage["preemptions"] for c in got) > 0
    assert len({tuple(c.token_ids) for c in expected}) == len(SETTINGS)


@pytest.mark.slow
def test_seeded_tokens_survive_a_lost_kv_pool(make_engine, smollm_tokenizer):
    ids = prompts(smollm_tokenizer)
    expected = make_engine(num_blocks=64).generate(ids, SETTINGS)
    engine = make_engine(num_blocks=64)
    request_ids = [engine.add_request(prompt_token_ids=p, sampling=s)
                   for p, s in zip(ids, SETTINGS)]
    for _ in range(6):  # prefill and a few decodes
        engine.step()
    # what the daemon does when its worker dies: every request recomputes on a fresh pool
    engine.scheduler.requeue_all()
    engine.runner.reset_kv()
    while engine.has_unfinished():
        engine.step()
    got = [engine.scheduler.get_request(r) for r in request_ids]
    assert [r.output_token_ids for r in got] == [c.token_ids for c in expected]
    assert sum(r.num_recomputed_tokens for r in got) > 0
