"""Triton: the sampler's exponential race over whole rows of the vocabulary (see `race`).

A program owns one chunk of one row: it hashes each token's noise, takes the two logs,
applies the temperature and the min_p cut and leaves its chunk's best race and token; a
torch argmax over the few chunks of a row picks the winner (the first of equal races, as
the torch definition's argmax does). The min_p cut needs the row max first: torch computes
it, one read of the logits.

For the same tokens as the torch code on CUDA, every float operation is the one torch's
CUDA kernels do: a correctly rounded division (`div_rn`, where Triton's `/` may approximate)
and libdevice's `logf`, which is what `tl.log` on float32 compiles to (a test reads the PTX).
In Triton's CPU interpreter `tl.log` is numpy's, which may differ from torch's CPU log in the
last bit: a row whose two best races come within an ulp could pick the other token there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels import checks

__all__ = ["race_full", "race_masked", "BLOCK"]

BLOCK = 4096  # tokens per program


@triton.jit
def _mix32(x):
    # lowbias32 in uint32 lanes, as the sampler's `_mix32`
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["vocab", "stride_row"])
def _race_kernel(Scores, Temperature, Keys, Threshold, Ids, Keep, ChunkBest, ChunkToken,
                 vocab, stride_row, num_chunks,
                 BLOCK: tl.constexpr, MASKED: tl.constexpr):
    # MASKED: position j of a row is token Ids[row, j] and races only where Keep[row, j]
    # (both contiguous); else position j is token j
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    positions = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = positions < vocab
    scores = tl.load(Scores + row.to(tl.int64) * stride_row + positions, mask=inside,
                     other=float("-inf"))
    scaled = tl.math.div_rn(scores, tl.load(Temperature + row))
    if MASKED:
        listed = row.to(tl.int64) * vocab + positions
        tokens = tl.load(Ids + listed, mask=inside, other=0)
        inside = inside & (tl.load(Keep + listed, mask=inside, other=0) != 0)
    else:
        tokens = positions
    threshold = tl.load(Threshold + row)
    lo = tl.load(Keys + 2 * row).to(tl.uint32)
    hi = tl.load(Keys + 2 * row + 1).to(tl.uint32)
    x = _mix32(tokens.to(tl.uint32) * 0x9E3779B1 + lo)
    x = _mix32(x ^ hi)
    x = _mix32(x + lo)
    uniform = ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    log_noise = tl.log(-tl.log(uniform))
    keep = (scaled >= threshold) & (scaled > float("-inf")) & inside
    race = tl.where(keep, scaled - log_noise, float("-inf"))
    best = tl.max(race, axis=0)
    position = chunk * BLOCK + tl.argmax(race, axis=0, tie_break_left=True)
    if MASKED:
        # where nothing races this is the chunk's first position: the row's first overall
        token = tl.load(Ids + row.to(tl.int64) * vocab + position)
    else:
        token = position
    tl.store(ChunkBest + row * num_chunks + chunk, best)
    tl.store(ChunkToken + row * num_chunks + chunk, token)


def race_full(scores: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
              log_min_p: torch.Tensor) -> torch.Tensor:
    """`race.race_full` on CUDA (or in Triton's interpreter); arguments checked there."""
    checks.require_same_device({"scores": scores, "temperature": temperature, "keys": keys,
                                "log_min_p": log_min_p})
    # keep = scaled >= row max + log(min_p): NaN (nothing races) where the max is NaN or
    # +inf and min_p is 0; the max of the scaled row is the scaled max, rounding being
    # monotonic
    threshold = scores.amax(-1) / temperature + log_min_p
    return _launch(scores, temperature, keys, threshold, None, None)


def race_masked(values: torch.Tensor, ids: torch.Tensor, keys: torch.Tensor,
                keep: torch.Tensor) -> torch.Tensor:
    """`race.race_masked` on CUDA (or in Triton's interpreter); arguments checked there."""
    checks.require_same_device({"values": values, "ids": ids, "keys": keys, "keep": keep})
    rows = values.shape[0]
    ones = torch.ones(rows, device=values.device)  # dividing by 1 changes no value
    threshold = torch.full((rows,), float("-inf"), device=values.device)
    return _launch(values, ones, keys, threshold, ids, keep)


def _launch(scores, temperature, keys, threshold, ids, keep) -> torch.Tensor:
    rows, vocab = scores.shape
    if rows == 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    num_chunks = triton.cdiv(vocab, BLOCK)
    chunk_best = torch.empty(rows, num_chunks, dtype=torch.float32, device=scores.device)
    chunk_token = torch.empty(rows, num_chunks, dtype=torch.int64, device=scores.device)
    masked = ids is not None
    with checks.on_device(scores):
        _race_kernel[(rows, num_chunks)](
            scores, temperature.contiguous(), keys.contiguous(), threshold.contiguous(),
            ids if masked else keys, keep if masked else keys, chunk_best, chunk_token,
            vocab, scores.stride(0), num_chunks, BLOCK=BLOCK, MASKED=masked, num_warps=8)
    # the first chunk holding the best race holds the first position with it
    return chunk_token.gather(1, chunk_best.argmax(-1, keepdim=True))[:, 0]
