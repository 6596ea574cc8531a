"""Batched sampling on the model's device: penalties, temperature, top-k/top-p/min-p, seeds.

Randomness never comes from a shared generator: each sampled token draws its noise from a
generator seeded by (request seed, index of the token). So a seeded request yields the same
tokens alone or in any batch, and again after a preemption or a worker restart.
"""

from __future__ import annotations

import torch

from sluice.actors.scheduler.plan import SampledToken, SamplingParams, ScheduledSeq

_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, index) pairs apart
_SEED_MASK = (1 << 63) - 1


def token_seed(request_seed: int, index: int) -> int:
    return (request_seed * _SEED_MIX + index * 0xBF58476D1CE4E5B9 + 1) & _SEED_MASK


def sample(logits: torch.Tensor, seqs: list[ScheduledSeq]) -> list[SampledToken]:
    """logits [len(seqs), vocab] float32, one row per sequence that samples this step."""
    if not seqs:
        return []
    raw_logprobs = None
    if any(s.sampling.logprobs is not None for s in seqs):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    if any(s.sampling.has_penalties for s in seqs):
        logits = logits.clone()
        for row, seq in enumerate(seqs):
            if seq.sampling.has_penalties:
                _apply_penalties(logits[row], seq)

    greedy = [row for row, s in enumerate(seqs) if s.sampling.greedy]
    chosen = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        chosen[rows] = logits[rows].argmax(dim=-1)
    for row, seq in enumerate(seqs):
        if not seq.sampling.greedy:
            chosen[row] = _sample_row(logits[row], seq)

    token_ids = chosen.tolist()
    results = []
    for row, (seq, token_id) in enumerate(zip(seqs, token_ids)):
        result = SampledToken(token_id=token_id)
        n = seq.sampling.logprobs
        if n is not None and raw_logprobs is not None:
            result.logprob = float(raw_logprobs[row, token_id])
            if n > 0:
                values, ids = raw_logprobs[row].topk(n)
                result.top_logprobs = list(zip(ids.tolist(), values.tolist()))
        results.append(result)
    return results


def _apply_penalties(row: torch.Tensor, seq: ScheduledSeq) -> None:
    params: SamplingParams = seq.sampling
    outputs = torch.tensor(seq.output_token_ids or [], dtype=torch.long, device=row.device)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor((seq.prompt_token_ids or []) + (seq.output_token_ids or []),
                            dtype=torch.long, device=row.device).unique()
        if seen.numel():
            values = row[seen]
            row[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                    values * params.repetition_penalty)
    if outputs.numel() and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(outputs, minlength=row.numel()).to(row.dtype)
        row -= params.frequency_penalty * counts
        row -= params.presence_penalty * (counts > 0).to(row.dtype)


def _sample_row(row: torch.Tensor, seq: ScheduledSeq) -> torch.Tensor:
    params = seq.sampling
    scaled = row / params.temperature
    if params.top_k and params.top_k < scaled.numel():
        kth = scaled.topk(params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cumulative = sorted_probs.cumsum(0)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (cumulative - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    generator = torch.Generator(device=row.device)
    generator.manual_seed(token_seed(seq.sampling_seed, seq.num_generated))
    # exponential race: argmax(p / E) with E ~ Exp(1) draws exactly from p
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax()
