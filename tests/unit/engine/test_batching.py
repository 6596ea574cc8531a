"""What continuous batching must not change: a request's tokens, whoever shares its steps."""

from __future__ import annotations

import math

import pytest
import torch

from sluice.actors.scheduler.plan import ScheduledSeq, StepPlan
from sluice.ipc.vocabulary import SamplingParams

TEXT = ("Paged attention keeps each sequence's keys and values in fixed-size blocks, so the "
        "memory of finished requests can be handed to new ones at once. ") * 3


def mixed_batch(tokenizer) -> list[tuple[list[int], SamplingParams]]:
    words = TEXT.split()
    batch = []
    for i in range(15):
        ids = tokenizer.encode(" ".join(words[: 3 + 5 * i]))
        sampling = (SamplingParams(max_tokens=4 + i, temperature=0.0) if i % 3 else
                    SamplingParams(max_tokens=6 + i, temperature=0.9, top_p=0.9, seed=100 + i))
        batch.append((ids, sampling))
    return batch


@pytest.mark.slow
def test_request_alone_and_in_a_batch_of_16_gives_the_same_tokens(make_engine, smollm_tokenizer):
    probe_ids = smollm_tokenizer.encode("The three primary colours are")
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_k=50, seed=1234)

    alone = make_engine()
    greedy_alone = alone.generate([probe_ids], greedy)[0].token_ids
    seeded_alone = alone.generate([probe_ids], seeded)[0].token_ids

    for probe in (greedy, seeded):
        engine = make_engine(max_prefill_chunk=16, token_budget=96)
        batch = mixed_batch(smollm_tokenizer)
        batch.insert(7, (probe_ids, probe))
        assert len(batch) == 16
        results = engine.generate([ids for ids, _ in batch], [sp for _, sp in batch])
        expected = greedy_alone if probe is greedy else seeded_alone
        assert results[7].token_ids == expected
    assert greedy_alone != seeded_alone  # the seeded probe really sampled


def test_every_live_sequence_holds_ceil_tokens_over_block_size_blocks(make_engine, smollm_tokenizer):
    engine = make_engine(max_prefill_chunk=7, token_budget=24)
    for words in (3, 11, 40):
        engine.add_request(" ".join(TEXT.split()[:words]),
                           sampling=SamplingParams(max_tokens=5, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
        engine.scheduler.check_invariants()
        for request_id in list(engine._tracked):
            request = engine.scheduler.get_request(request_id)
            expected = math.ceil(request.num_computed_tokens / 16)
            assert len(request.block_ids) == expected


@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_chunked_prefill_gives_the_same_next_token_logits(smollm_model, smollm_path,
                                                          smollm_tokenizer, chunk):
    from sluice.actors.executor.runner import ModelRunner

    prompt = smollm_tokenizer.encode(TEXT * 2)[:100]
    assert len(prompt) == 100
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    blocks = list(range(math.ceil(len(prompt) / 16)))

    def logits_after(chunk_size: int) -> torch.Tensor:
        runner = ModelRunner(model=smollm_model, model_path=smollm_path, num_blocks=16)
        logits = None
        for step, start in enumerate(range(0, len(prompt), chunk_size)):
            piece = prompt[start:start + chunk_size]
            last = start + len(piece) == len(prompt)
            seq = ScheduledSeq("r", piece, start, blocks, sample=last, sampling=greedy)
            logits = runner.forward_logits(StepPlan(step, [seq]))
        return logits[0]

    one_shot = logits_after(len(prompt))
    torch.testing.assert_close(logits_after(chunk), one_shot, atol=1e-4, rtol=0)
