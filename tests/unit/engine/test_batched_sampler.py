"""The batched sampler draws exactly the tokens of the plain one-row-at-a-time definition
(`reference_sample`), whatever mix of settings shares the batch, and its draws follow the
distribution the settings describe."""

from __future__ import annotations

import itertools

import torch

from sluice.actors.executor.sampler import CANDIDATES, reference_sample, sample
from sluice.actors.scheduler.plan import ScheduledSeq
from sluice.ipc.vocabulary import SamplingParams

VOCAB = 3000  # wider than CANDIDATES: flat rows need the full-sort fallback, peaked ones don't

SETTINGS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=0.7, top_k=40),
    SamplingParams(temperature=1.3, top_k=500, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.9, top_p=0.8, min_p=0.02),
    SamplingParams(temperature=1.0, top_p=0.5, repetition_penalty=1.3),
    SamplingParams(temperature=0.6, frequency_penalty=0.5, presence_penalty=0.3, top_k=5),
    SamplingParams(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.5),
]


def make_seq(params: SamplingParams, seed: int, index: int) -> ScheduledSeq:
    history = [(seed * 7 + i * 13) % VOCAB for i in range(12)]
    return ScheduledSeq(f"r{seed}", [0], 0, [0], True, params, num_generated=index,
                        sampling_seed=seed, prompt_token_ids=history[:6],
                        output_token_ids=history[6:])


def logits_rows(n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # every other row is flat (a wide nucleus), the rest peaked, as real logits are
    spread = torch.tensor([0.3 if i % 2 else 4.0 for i in range(n)])[:, None]
    return torch.randn(n, VOCAB, generator=generator) * spread


def test_batched_tokens_equal_the_per_row_reference_for_every_mix_of_settings():
    rows = 60
    logits = logits_rows(rows, seed=1)
    seqs = [make_seq(params, seed=1000 + i, index=i % 9)
            for i, params in zip(range(rows), itertools.cycle(SETTINGS))]
    batched = [t.token_id for t in sample(logits, seqs)]
    expected = [reference_sample(logits[i], seqs[i]) for i in range(rows)]
    assert batched == expected
    # the mix really exercised both paths of a top-p row: nuclei inside and beyond CANDIDATES
    probs = torch.softmax(logits / 0.8, -1).sort(-1, descending=True).values
    widths = (probs.cumsum(-1) < 0.95).sum(-1)
    assert (widths < CANDIDATES).any() and (widths >= CANDIDATES).any()


def test_a_row_draws_the_same_token_alone_and_in_any_batch():
    logits = logits_rows(24, seed=2)
    seqs = [make_seq(SETTINGS[i % len(SETTINGS)], seed=50 + i, index=3) for i in range(24)]
    together = [t.token_id for t in sample(logits, seqs)]
    alone = [sample(logits[i:i + 1], [seqs[i]])[0].token_id for i in range(24)]
    shuffled = list(reversed(range(24)))
    reordered = sample(logits[shuffled], [seqs[i] for i in shuffled])
    assert together == alone
    assert [reordered[shuffled.index(i)].token_id for i in range(24)] == together


def test_draws_follow_the_top_p_nucleus_distribution():
    # many seeds over one row: the frequencies match the renormalised nucleus
    row = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.0] + [-4.0] * 40])
    params = SamplingParams(temperature=1.0, top_p=0.9)
    draws = torch.tensor([sample(row, [make_seq(params, seed=s, index=0)])[0].token_id
                          for s in range(3000)])
    probs = torch.softmax(row[0], -1)
    nucleus = int((probs.cumsum(-1) - probs < 0.9).sum())
    expected = torch.zeros_like(probs)
    expected[:nucleus] = probs[:nucleus] / probs[:nucleus].sum()
    observed = torch.bincount(draws, minlength=row.shape[1]).float() / len(draws)
    assert observed[nucleus:].sum() == 0  # nothing outside the nucleus
    assert torch.allclose(observed, expected, atol=0.03)
