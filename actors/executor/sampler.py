"""Batched sampling on the model's device: penalties, temperature, top-k/top-p/min-p, seeds.

The whole batch is sampled in a few tensor ops, with no loop over rows: penalties are
scattered for all rows at once; rows with a top-k or top-p bound work on their `topk`
candidates (`CANDIDATES` of them for a top-p-only row, or every token of a row whose nucleus
is wider than that: a batched full sort of those rows only); rows with neither race over
the whole vocabulary, which needs no sort: in one fused pass per row where the op of
`sluice.kernels.race` runs (C++ on CPU, Triton on CUDA), the torch code here defining it.

Randomness never comes from a shared generator. A token is drawn by an exponential race,
argmax over kept tokens of (logit / temperature - log E), where E ~ Exp(1) is a hash of
(request seed, index of the token being sampled, candidate token id) — counter-based, so a
seeded request yields the same tokens alone or in any batch, however many candidates its
batch looks at, and again after a preemption or a worker restart. `reference_sample` is
the same distribution written one row at a time over the full vocabulary: the plain
definition the batched path must agree with token for token.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sluice.actors.scheduler.plan import MATCHER_STEPS, SampledToken, ScheduledSeq
from sluice.kernels import race as fused_race

_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, index) pairs apart
_SEED_MASK = (1 << 63) - 1
_LOW32 = 0xFFFFFFFF
# a top-p row without top-k first looks at this many best tokens; when their mass falls
# short of top_p the row falls back to a full sort (in one batched sort with its like)
CANDIDATES = 256


def token_seed(request_seed: int, index: int) -> int:
    return (request_seed * _SEED_MIX + index * 0xBF58476D1CE4E5B9 + 1) & _SEED_MASK


def sample(logits: torch.Tensor, seqs: list[ScheduledSeq],
           masks: tuple[list[int], np.ndarray] | None = None) -> list[SampledToken]:
    """logits [len(seqs), vocab] float32, one row per sequence that samples this step.

    `masks`: (rows, int32 bitmask [len(rows), ceil(vocab / 32)]) for the rows whose output
    follows a grammar (`grammar.Constraints.masks`): a token whose bit is clear is never
    drawn. The logit bias and the masks act before penalties and temperature; the logprobs
    a request asked for are still those of the model's own logits."""
    if not seqs:
        return []
    device = logits.device
    scores = logits
    if masks is not None or any(s.sampling.logit_bias_ids for s in seqs):
        scores = apply_bias_and_masks(logits, seqs, masks)
    if any(s.sampling.has_penalties for s in seqs):
        scores = apply_penalties(scores, seqs)
    sampled = [row for row, s in enumerate(seqs) if not s.sampling.greedy]
    if len(sampled) == len(seqs):  # every row races: no argmax, no copy of the rows
        return _results(logits, seqs, _sample_rows(scores, seqs))
    chosen = fused_race.argmax(scores)  # greedy rows keep this; sampled rows are overwritten
    if sampled:
        rows = torch.tensor(sampled, device=device)
        chosen[rows] = _sample_rows(scores[rows], [seqs[r] for r in sampled])
    return _results(logits, seqs, chosen)


def apply_bias_and_masks(logits: torch.Tensor, seqs: list[ScheduledSeq],
                         masks: tuple[list[int], np.ndarray] | None) -> torch.Tensor:
    """A copy of the logits with each row's logit bias added and grammar masks applied."""
    scores = logits.clone()
    rows, ids, values = [], [], []
    for row, seq in enumerate(seqs):
        bias = seq.sampling
        if bias.logit_bias_ids:
            rows += [row] * len(bias.logit_bias_ids)
            ids += bias.logit_bias_ids
            values += bias.logit_bias_values
    vocab = scores.shape[1]
    if ids:
        # an id past this model's vocabulary (the front checks them) biases nothing
        kept = [i for i, token in enumerate(ids) if token < vocab]
        if kept:
            flat = torch.tensor([rows[i] * vocab + ids[i] for i in kept], device=scores.device)
            scores.view(-1).index_add_(0, flat, torch.tensor([values[i] for i in kept],
                                                             dtype=scores.dtype,
                                                             device=scores.device))
    if masks is not None:
        mask_rows, bitmask = masks
        allowed = unpack_bitmask(torch.from_numpy(bitmask).to(scores.device), vocab)
        index = torch.tensor(mask_rows, device=scores.device)
        scores[index] = scores[index].masked_fill(~allowed, float("-inf"))
    return scores


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab] from int32 words [rows, ceil(vocab / 32)], bit i of word w being
    token 32 * w + i."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_penalties(logits: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output) penalties, all rows."""
    scores = logits.clone()
    vocab = logits.shape[1]
    rep_rows, rep_ids, out_rows, out_ids = [], [], [], []
    for row, seq in enumerate(seqs):
        params = seq.sampling
        outputs = seq.output_token_ids or []
        if params.repetition_penalty != 1.0:
            seen = (seq.prompt_token_ids or []) + outputs
            rep_rows += [row] * len(seen)
            rep_ids += seen
        if params.presence_penalty or params.frequency_penalty:
            out_rows += [row] * len(outputs)
            out_ids += outputs

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(s.sampling, name) for s in seqs], dtype=scores.dtype,
                            device=scores.device)[:, None]

    if rep_ids:
        seen = torch.zeros_like(scores, dtype=torch.bool)
        seen[torch.tensor(rep_rows, device=scores.device),
             torch.tensor(rep_ids, device=scores.device)] = True
        penalty = per_row("repetition_penalty")
        penalised = torch.where(scores > 0, scores / penalty, scores * penalty)
        scores = torch.where(seen, penalised, scores)
    if out_ids:
        counts = torch.zeros_like(scores)
        flat = (torch.tensor(out_rows, device=scores.device) * vocab
                + torch.tensor(out_ids, device=scores.device))
        counts.view(-1).index_add_(0, flat, torch.ones(len(out_ids), dtype=scores.dtype,
                                                       device=scores.device))
        scores -= per_row("frequency_penalty") * counts
        scores -= per_row("presence_penalty") * (counts > 0).to(scores.dtype)
    return scores


class PenaltyIds:
    """The worker's copy of the ids each request with penalties has, so that its plans need
    not carry them every step. A plan carries a penalized request's prompt and whole output
    where this copy may lack them (its first sampling step, a recompute after a preemption or
    a lost worker, a request not planned for `MATCHER_STEPS`), and else only the end of its
    output: the output ids from index `num_generated - len(output_token_ids)` on. `fill`
    takes them and gives each sampling sequence its full lists back, for `apply_penalties`.
    A copy not used for `idle_steps` steps (a request ended, or paused) is dropped."""

    def __init__(self, idle_steps: int = 2 * MATCHER_STEPS):
        self.idle_steps = idle_steps
        self._ids: dict[str, tuple[list[int] | None, list[int], int]] = {}
        self._step = 0

    def __len__(self) -> int:
        return len(self._ids)

    def fill(self, seqs: list[ScheduledSeq]) -> None:
        """Complete the prompt and output ids of the penalized ones of `seqs` (the sequences
        that sample this step) from what this worker kept, and keep what they carry. Taking
        the same plan twice (a step retried) gives the same lists."""
        self._step += 1
        for seq in seqs:
            if not seq.sampling.has_penalties:
                continue
            rid = seq.request_id
            carried = seq.output_token_ids or []
            first = seq.num_generated - len(carried)  # the output index of the first carried
            kept = self._ids.get(rid)
            prompt = seq.prompt_token_ids
            if prompt is None and seq.sampling.repetition_penalty != 1.0:
                if kept is None or kept[0] is None:
                    raise ValueError(f"request {rid!r}: its plan carries no prompt ids, and "
                                     f"this worker has none of them")
                prompt = kept[0]
            if first == 0:  # carried whole: this copy starts again from it
                outputs = list(carried)
            elif kept is None or not 0 < first <= len(kept[1]):
                raise ValueError(
                    f"request {rid!r}: its plan carries its output from token {first}, and "
                    f"this worker has {0 if kept is None else len(kept[1])} of its ids")
            else:
                outputs = kept[1]
                del outputs[first:]
                outputs.extend(carried)
            self._ids[rid] = (prompt, outputs, self._step)
            seq.prompt_token_ids = prompt
            seq.output_token_ids = outputs
        if self._step % 16 == 0:
            idle = [rid for rid, (_, _, seen) in self._ids.items()
                    if self._step - seen > self.idle_steps]
            for rid in idle:
                del self._ids[rid]


def _sample_rows(logits: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
    """Token ids [rows] for rows that all sample (temperature > 0)."""
    device, vocab = logits.device, logits.shape[1]
    params = [s.sampling for s in seqs]
    temperature = torch.tensor([p.temperature for p in params], device=device)
    keys = race_keys(seqs, device)
    chosen = torch.empty(len(seqs), dtype=torch.long, device=device)
    bounded = [i for i, p in enumerate(params) if (0 < p.top_k < vocab) or p.top_p < 1.0]
    unbounded = sorted(set(range(len(params))) - set(bounded))
    if unbounded:
        rows = torch.tensor(unbounded, device=device)
        min_p = torch.tensor([params[i].min_p for i in unbounded], device=device)
        whole = logits if len(unbounded) == len(params) else logits[rows]
        chosen[rows] = race_whole_vocabulary(whole, temperature[rows], keys[rows], min_p)
    if bounded:
        k_needed = [params[i].top_k if 0 < params[i].top_k < vocab else CANDIDATES
                    for i in bounded]
        rows = torch.tensor(bounded, device=device)
        scaled = logits[rows] / temperature[rows][:, None]
        chosen[rows] = _sample_candidates(scaled, keys[rows], [params[i] for i in bounded],
                                          k_needed)
    return chosen


def race_whole_vocabulary(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                          min_p: torch.Tensor, *, fused: bool = True) -> torch.Tensor:
    """The winning token id per row of a race over every token: rows with neither top-k nor
    top-p. logits float32 [rows, vocab]; temperature and min_p float32 [rows]; keys as
    `race_keys` gives them.

    The fused op of `sluice.kernels.race` (C++ on CPU, Triton on CUDA: one pass over the
    logits) where it runs, else, or with `fused=False`, this torch code, its definition:
    the two give the same tokens."""
    if fused and logits.shape[0] and fused_race.available(logits.device):
        return fused_race.race_full(logits.contiguous(), temperature, keys, torch.log(min_p))
    vocab = logits.shape[1]
    ids = torch.arange(vocab, device=logits.device).expand(logits.shape[0], vocab)
    return _race(logits / temperature[:, None], ids, keys, min_p[:, None], None, None,
                 fused=False)


def _sample_candidates(scaled: torch.Tensor, keys: torch.Tensor, params, k_needed: list[int]):
    device, vocab = scaled.device, scaled.shape[1]
    width = min(max(k_needed), vocab)
    values, ids = scaled.topk(width, dim=-1)  # sorted, best first
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params],
                         device=device)[:, None]
    values = values.masked_fill(torch.arange(width, device=device)[None, :] >= top_k,
                                float("-inf"))
    # top_p 1.0 cuts nothing, not even a tail that float rounding pushes past 1.0
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else math.inf for p in params],
                         device=device)[:, None]
    # the mass the top_p cut is measured against: the whole (top-k-cut) row
    normalizer = torch.where(top_k < vocab, values.logsumexp(-1, keepdim=True),
                             scaled.logsumexp(-1, keepdim=True))
    # a top-p row without top-k is decided among its candidates when their mass reaches
    # top_p: its nucleus then ends inside them
    covered = (values - normalizer).exp().sum(-1) >= top_p[:, 0]
    short = ((top_k[:, 0] >= vocab) & ~covered).nonzero()[:, 0] if width < vocab else None
    min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
    chosen = _race(values, ids, keys, min_p, top_p, normalizer)
    if short is not None and short.numel():
        chosen[short] = _race_wide_nuclei(scaled[short].contiguous(), keys[short],
                                          min_p[short], top_p[short], normalizer[short])
    return chosen


def _race_wide_nuclei(scaled: torch.Tensor, keys: torch.Tensor, min_p: torch.Tensor,
                      top_p: torch.Tensor, normalizer: torch.Tensor) -> torch.Tensor:
    """The race of rows whose top-p nucleus is wider than the candidates. Its definition
    sorts each whole row; where the CPU op finds each nucleus's floor by selection, the
    tokens under it are masked instead and the row races unsorted, with the same winner (the
    race of a token does not depend on its position)."""
    floor = fused_race.nucleus_floor(scaled, normalizer[:, 0], top_p[:, 0].float())
    if floor is None:
        all_values, all_ids = scaled.sort(dim=-1, descending=True)
        return _race(all_values, all_ids, keys, min_p, top_p, normalizer)
    nucleus = scaled.masked_fill(scaled < floor[:, None], float("-inf"))
    ones = torch.ones(scaled.shape[0], device=scaled.device)
    return race_whole_vocabulary(nucleus, ones, keys, min_p[:, 0])


def _race(values: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor, min_p: torch.Tensor,
          top_p: torch.Tensor | None, normalizer: torch.Tensor | None, *,
          fused: bool = True) -> torch.Tensor:
    """The winning token id per row among candidates `ids` with scaled logits `values`.

    With `top_p`, the candidates must be sorted best first and `normalizer` is the log of
    the row's total mass; without it the candidates may come in any order. The cuts are
    made here; the race itself runs in the fused op of `sluice.kernels.race` where it runs
    (and `fused`), else in the torch code below, which defines it.
    """
    row_max = values.max(-1, keepdim=True).values
    # min_p keeps tokens with probability >= min_p * the top probability
    keep = values >= row_max + torch.log(min_p)  # log(0) = -inf keeps every token
    if top_p is not None:
        probs = (values - normalizer).exp() * keep
        before = probs.cumsum(-1) - probs
        # the smallest prefix whose mass reaches top_p (the first token always stays), and
        # every token tied with its last one: where a sort puts equal values is arbitrary (and
        # bf16 logits tie often), and `nucleus_floor`, which selects without sorting, keeps
        # them all
        nucleus = before < top_p
        last = torch.where(nucleus, values, math.inf).min(-1, keepdim=True).values
        keep &= values >= last
    # a masked token (-inf) never races: its noise may be 0, and -inf - log(0) is NaN,
    # which argmax would pick
    keep &= values > float("-inf")
    if fused and values.shape[0] and fused_race.available(values.device):
        return fused_race.race_masked(values.contiguous(), ids, keys, keep)
    noise = exponential_noise(keys, ids)
    race = torch.where(keep, values - noise.log(), float("-inf"))
    return ids.gather(1, race.argmax(-1, keepdim=True))[:, 0]


# -- counter-based noise ----------------------------------------------------------------------


def race_keys(seqs: list[ScheduledSeq], device) -> torch.Tensor:
    """[rows, 2] int64: the two 32-bit halves of each row's (seed, token index) key."""
    keys = [token_seed(s.sampling_seed, s.num_generated) for s in seqs]
    return torch.tensor([[k & _LOW32, (k >> 32) & _LOW32] for k in keys], dtype=torch.long,
                        device=device)


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x * constant mod 2**32 for x < 2**32, in int64 lanes that never overflow: the constant
    is split into 16-bit halves, so no partial product reaches 2**63."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _LOW32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # a 32-bit avalanche finalizer (lowbias32)
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def exponential_noise(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """E ~ Exp(1) per (row key, token id), float32 [rows, candidates]; the same token of the
    same row always gets the same E."""
    lo, hi = keys[:, :1], keys[:, 1:]
    x = _mix32((_mul32(ids, 0x9E3779B1) + lo) & _LOW32)
    x = _mix32(x ^ hi)
    x = _mix32((x + lo) & _LOW32)
    uniform = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -torch.log(uniform)


# -- results ----------------------------------------------------------------------------------


def _results(logits: torch.Tensor, seqs: list[ScheduledSeq],
             chosen: torch.Tensor) -> list[SampledToken]:
    token_ids = chosen.tolist()
    results = [SampledToken(token_id=t) for t in token_ids]
    wanted = [row for row, s in enumerate(seqs) if s.sampling.logprobs is not None]
    if not wanted:
        return results
    rows = torch.tensor(wanted, device=logits.device)
    logprobs = torch.log_softmax(logits[rows], dim=-1)  # of the raw logits, as before
    picked = logprobs.gather(1, chosen[rows][:, None])[:, 0].tolist()
    n_max = max(seqs[row].sampling.logprobs for row in wanted)
    top_values, top_ids = logprobs.topk(n_max, dim=-1) if n_max else (None, None)
    for i, row in enumerate(wanted):
        n = seqs[row].sampling.logprobs
        top = list(zip(top_ids[i, :n].tolist(), top_values[i, :n].tolist())) if n > 0 else None
        results[row] = SampledToken(token_ids[row], picked[i], top)
    return results


def reference_sample(logits: torch.Tensor, seq: ScheduledSeq) -> int:
    """One row, the plain way: the definition `sample` must agree with (used by tests)."""
    params = seq.sampling
    row = logits[None].clone()
    if params.logit_bias_ids:
        row = apply_bias_and_masks(row, [seq], None)
    if params.has_penalties:
        row = apply_penalties(row, [seq])
    row = row[0]
    if params.greedy:
        return int(row.argmax())
    scaled = row / torch.tensor(params.temperature)  # a float32 divisor, as `sample` uses
    if 0 < params.top_k < scaled.numel():
        kth = scaled.topk(params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    keep = probs >= params.min_p * probs.max()
    if params.top_p < 1.0:
        sorted_probs, order = (probs * keep).sort(descending=True)
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= params.top_p
        # every token tied with the nucleus's last one stays too (see `_race`)
        last = scaled[order[~drop]].min()
        keep &= scaled >= last
    ids = torch.arange(scaled.numel())
    keys = race_keys([seq], logits.device)
    noise = exponential_noise(keys, ids[None])[0]
    race = torch.where(keep & (scaled > float("-inf")), scaled - noise.log(), float("-inf"))
    return int(race.argmax())
