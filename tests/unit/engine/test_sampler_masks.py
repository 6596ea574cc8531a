"""The batched sampler's logit bias and grammar masks: a masked token is never drawn, however
its noise falls, and a bias moves the batched draw exactly as it moves the reference one."""

from __future__ import annotations

import numpy as np
import torch

from sluice.actors.executor.sampler import reference_sample, sample, unpack_bitmask
from sluice.actors.scheduler.plan import ScheduledSeq
from sluice.ipc.vocabulary import SamplingParams

VOCAB = 49152
WORDS = (VOCAB + 31) // 32


def seq(i: int, generated: int, **params) -> ScheduledSeq:
    return ScheduledSeq(f"r{i}", [1], 0, [0], True, SamplingParams(**params),
                        num_generated=generated, sampling_seed=1000 + i)


def test_a_masked_token_is_never_drawn() -> None:
    generator = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    for step in range(40):
        logits = torch.randn(4, VOCAB, generator=generator) * 4
        allowed = [rng.choice(VOCAB, size=1 + i, replace=False) for i in range(4)]
        bitmask = np.zeros((4, WORDS), dtype=np.int32)
        for row, ids in enumerate(allowed):
            for token in ids:
                bitmask.view(np.uint32)[row, token // 32] |= np.uint32(1 << (token % 32))
        unpacked = unpack_bitmask(torch.from_numpy(bitmask), VOCAB)
        assert [set(np.flatnonzero(r.numpy())) for r in unpacked] == [set(a) for a in allowed]
        seqs = [seq(0, step, temperature=1.0, grammar_kind="regex", grammar="x"),
                seq(1, step, temperature=0.7, top_p=0.9, grammar_kind="regex", grammar="x"),
                seq(2, step, temperature=0.0, grammar_kind="regex", grammar="x"),
                seq(3, step, temperature=1.3, top_k=5, grammar_kind="regex", grammar="x")]
        drawn = [t.token_id for t in sample(logits, seqs, ([0, 1, 2, 3], bitmask))]
        for row, token in enumerate(drawn):
            assert token in allowed[row], (step, row)


def test_a_masked_token_whose_noise_is_zero_is_not_drawn() -> None:
    """Seed 7's output token 159 draws E = 0 for token 7547 (its uniform rounds to 1.0): log(0) is
    -inf, and a masked -inf minus it is NaN, which an argmax would pick."""
    logits = torch.zeros(1, VOCAB)
    bitmask = np.zeros((1, WORDS), dtype=np.int32)
    bitmask.view(np.uint32)[0, 0] = np.uint32(0b1110)  # tokens 1, 2 and 3 only
    params = dict(temperature=1.0, grammar_kind="regex", grammar="x")
    row = ScheduledSeq("r", [1], 0, [0], True, SamplingParams(**params), num_generated=159,
                       sampling_seed=7)
    assert sample(logits, [row], ([0], bitmask))[0].token_id in (1, 2, 3)


def test_a_logit_bias_acts_as_in_the_reference() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB, generator=generator)
    best = int(logits[2].argmax())
    seqs = [seq(0, 3, temperature=1.0, logit_bias_ids=(5, 7), logit_bias_values=(100.0, -3.0)),
            seq(1, 3, temperature=0.8, logit_bias_ids=(9,), logit_bias_values=(2.5,)),
            seq(2, 3, temperature=0.0, logit_bias_ids=(best,), logit_bias_values=(-100.0,))]
    drawn = [t.token_id for t in sample(logits, seqs)]
    assert drawn == [reference_sample(logits[i], s) for i, s in enumerate(seqs)]
    assert drawn[0] == 5  # +100 wins outright
    assert drawn[2] != best  # -100 takes the greedy token out
