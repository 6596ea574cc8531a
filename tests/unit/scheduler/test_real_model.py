"""The scheduler on the embedded model: preemption and prefix caching keep greedy tokens exact."""

from __future__ import annotations

import pytest

from sluice.ipc.vocabulary import SamplingParams

TEXT = (
    "A paged KV cache stores keys and values in fixed-size blocks, so a scheduler can hand "
    "the memory of a finished request to a new one at once and share common prefixes. "
)


@pytest.mark.slow
def test_small_pool_preempts_yet_every_request_gets_the_ample_pool_tokens(
    make_engine, smollm_tokenizer
):
    words = TEXT.split()
    prompts = [smollm_tokenizer.encode(" ".join(words[i : i + 10 + 2 * i])) for i in range(4)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tenants = ["a", "b", "a", "b"]

    ample = make_engine(num_blocks=32, enable_prefix_caching=False)
    expected = ample.generate(prompts, greedy)

    # 5 blocks of 16 tokens cannot hold four requests of ~25-40 tokens each
    tight = make_engine(
        num_blocks=5,
        enable_prefix_caching=False,
        kv_high_watermark=1.0,
        kv_low_watermark=1.0,
        policy="fcfs",
    )
    ids = [
        tight.add_request(prompt_token_ids=p, sampling=greedy, tenant=t)
        for p, t in zip(prompts, tenants, strict=True)
    ]
    done = {}
    while tight.has_unfinished():
        for out in tight.step():
            if out.finished:
                done[out.request_id] = out
        tight.scheduler.check_invariants()
    got = [tight.scheduler.get_request(i).output_token_ids for i in ids]
    assert got == [c.token_ids for c in expected]
    usage = tight.scheduler.ledger.usage.values()  # the tenants are idle: only their usage is kept
    preemptions = sum(t.preemptions for t in usage)
    recomputed = sum(t.recomputed_tokens for t in usage)
    assert preemptions > 0 and recomputed > 0
    assert sum(done[i].usage["preemptions"] for i in ids) == preemptions
    assert sum(done[i].usage["recomputed_tokens"] for i in ids) == recomputed
    assert tight.scheduler.kv_cache.num_used_blocks == 0


@pytest.mark.slow
def test_shared_prefix_is_served_from_the_cache_with_the_same_tokens(make_engine, smollm_tokenizer):
    prefix = smollm_tokenizer.encode(TEXT)
    assert len(prefix) > 32
    first = prefix + smollm_tokenizer.encode(" Question: what is a block?")
    second = prefix + smollm_tokenizer.encode(" Question: why share prefixes?")
    greedy = SamplingParams(max_tokens=6, temperature=0.0)

    uncached = make_engine(num_blocks=32, enable_prefix_caching=False)
    expected = uncached.generate([second], greedy)[0].token_ids

    engine = make_engine(num_blocks=32)
    engine.generate([first], greedy)
    rid = engine.add_request(prompt_token_ids=second, sampling=greedy)
    plan = engine.scheduler.schedule()
    (seq,) = plan.seqs
    request = engine.scheduler.get_request(rid)
    cached = request.num_cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached <= len(prefix)
    assert seq.start_pos == cached  # only the rest of the prompt is prefilled
    result = engine.runner.execute(plan)
    engine.scheduler.update(plan, result)
    while engine.has_unfinished():
        engine.step()
    done = engine.scheduler.get_request(rid)
    assert done.output_token_ids == expected
    assert done.num_prefill_tokens == len(second) - cached
