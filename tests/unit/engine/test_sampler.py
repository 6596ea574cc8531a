"""The sampler's promises: the filters do what their names say, seeds are per request."""

from __future__ import annotations

import math

import pytest
import torch

from sluice.actors.executor.sampler import sample
from sluice.actors.scheduler.plan import ScheduledSeq
from sluice.ipc.vocabulary import InvalidParams, SamplingParams


def seq(params: SamplingParams, *, seed: int = 7, index: int = 0, prompt=None, output=None):
    return ScheduledSeq("r", [0], 0, [0], True, params, num_generated=index, sampling_seed=seed,
                        prompt_token_ids=prompt, output_token_ids=output)


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


def draws(params: SamplingParams, n: int = 400) -> list[int]:
    return [sample(LOGITS, [seq(params, seed=s)])[0].token_id for s in range(n)]


def test_greedy_takes_the_argmax_and_reports_logprobs():
    [token] = sample(LOGITS, [seq(SamplingParams(temperature=0.0, logprobs=2))])
    assert token.token_id == 0
    expected = torch.log_softmax(LOGITS[0], -1)
    assert math.isclose(token.logprob, float(expected[0]), rel_tol=1e-6)
    assert [i for i, _ in token.top_logprobs] == [0, 1]


def test_sampling_follows_the_softmax_distribution():
    counts = torch.bincount(torch.tensor(draws(SamplingParams(temperature=1.0), 4000)),
                            minlength=6).float() / 4000
    probs = torch.softmax(LOGITS[0], -1)
    assert torch.allclose(counts, probs, atol=0.03)


def test_top_k_top_p_and_min_p_cut_the_tail():
    assert set(draws(SamplingParams(temperature=1.0, top_k=2))) <= {0, 1}
    probs = torch.softmax(LOGITS[0], -1)
    # top_p just above the first token's mass keeps exactly the first two tokens
    assert set(draws(SamplingParams(temperature=1.0, top_p=float(probs[0]) + 0.01))) == {0, 1}
    assert set(draws(SamplingParams(temperature=1.0, top_p=float(probs[0]) - 0.01))) == {0}
    # min_p keeps tokens with at least min_p times the top probability
    kept = {i for i in range(6) if probs[i] >= 0.3 * probs[0]}
    assert set(draws(SamplingParams(temperature=1.0, min_p=0.3))) == kept


def test_the_same_seed_and_index_give_the_same_token_whatever_the_batch():
    params = SamplingParams(temperature=1.5)
    alone = sample(LOGITS, [seq(params, seed=42, index=3)])[0].token_id
    noisy_rows = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    batch = torch.cat([noisy_rows[:2], LOGITS, noisy_rows[2:]])
    seqs = [seq(params, seed=s) for s in (1, 2)] + [seq(params, seed=42, index=3)]
    seqs += [seq(params, seed=s) for s in (3, 4, 5)]
    assert sample(batch, seqs)[2].token_id == alone
    # another token index draws other noise
    assert len({sample(LOGITS, [seq(params, seed=42, index=i)])[0].token_id
                for i in range(40)}) > 1


def test_penalties_push_seen_tokens_down():
    rep = SamplingParams(temperature=0.0, repetition_penalty=100.0)
    assert sample(LOGITS, [seq(rep, prompt=[0], output=[])])[0].token_id == 1
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.6)
    # token 0 seen twice: 2.0 - 1.2 = 0.8 < 1.0
    assert sample(LOGITS, [seq(freq, output=[0, 0])])[0].token_id == 1
    assert sample(LOGITS, [seq(freq, output=[0])])[0].token_id == 0
    presence = SamplingParams(temperature=0.0, presence_penalty=1.5)
    assert sample(LOGITS, [seq(presence, output=[0, 0, 0])])[0].token_id == 1


@pytest.mark.parametrize("field_name, value", [
    ("max_tokens", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
    ("min_p", 2.0), ("repetition_penalty", 0.0), ("seed", -3), ("logprobs", 99),
])
def test_out_of_range_parameters_are_rejected_by_name(field_name, value):
    with pytest.raises(InvalidParams) as info:
        SamplingParams(**{field_name: value})
    assert info.value.field == field_name
    assert field_name in str(info.value)
