"""Comparing greedy token sequences computed in a low-precision dtype.

In float32 two correct engines give the same greedy tokens. In bfloat16 they agree only up to
the first *near tie*: a position where the reference's best two logits are closer than the
dtype can tell apart, so any rounding difference (another GEMM blocking, another summation
order) may pick the other token, and everything after it legitimately differs. These helpers
compare up to that position and fail on any difference before it.
"""

from __future__ import annotations

import math

import torch

MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}
# rounding differences between two bf16 implementations accumulate over the layers: a
# margin within this many units in the last place of the top logit counts as a near tie
NEAR_TIE_ULPS = 2


def resolution(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` numbers around `value` (one unit in the last place)."""
    magnitude = max(abs(value), 2.0 ** -14)
    return 2.0 ** (math.floor(math.log2(magnitude)) - MANTISSA_BITS[dtype])


def first_near_tie(top2: list[tuple[float, float]], dtype: torch.dtype,
                   ulps: int = NEAR_TIE_ULPS) -> int:
    """Index of the first position whose top-2 margin is within `ulps` of the dtype's
    resolution at the top logit; len(top2) when there is none."""
    for position, (best, second) in enumerate(top2):
        if best - second <= ulps * resolution(best, dtype):
            return position
    return len(top2)


def assert_equal_until_near_tie(ours: list[int], reference: list[int],
                                reference_top2: list[tuple[float, float]],
                                dtype: torch.dtype) -> int:
    """Fail on the first differing token before the reference's first near tie; return how
    many positions were compared."""
    compared = min(first_near_tie(reference_top2, dtype), len(reference), len(ours))
    for position in range(compared):
        if ours[position] != reference[position]:
            best, second = reference_top2[position]
            raise AssertionError(
                f"token {position} differs ({ours[position]} != {reference[position]}) with a "
                f"reference top-2 margin of {best - second:.4g}, above "
                f"{NEAR_TIE_ULPS} x {resolution(best, dtype):.4g}: not a near tie")
    return compared


def top2_margins(scores: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> list[tuple[float, float]]:
    """(best, second) logit per position from per-step score rows ([1, vocab] each)."""
    pairs = []
    for step in scores:
        best, second = step[0].float().topk(2).values.tolist()
        pairs.append((best, second))
    return pairs


def teacher_forced_top2(runner, prompt_ids: list[int],
                        token_ids: list[int]) -> list[tuple[float, float]]:
    """(best, second) logit before each of `token_ids`, from one forward of prompt + tokens
    on a fresh pool of `runner` (a sluice ModelRunner): the margins of a sluice run."""
    from sluice.actors.executor.model import AttentionInputs

    ids = torch.tensor(prompt_ids + token_ids[:-1])
    n, block_size = len(ids), runner.block_size
    blocks = -(-n // block_size)
    attn = AttentionInputs(slot_mapping=torch.arange(n),
                           block_tables=torch.arange(blocks, dtype=torch.int32)[None],
                           query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                           seq_lens=torch.tensor([n], dtype=torch.int32))
    pool = runner.model.new_kv_pool(blocks, block_size)
    hidden = runner.model.forward(ids, torch.arange(n), pool, attn)
    logits = runner.model.logits(hidden[len(prompt_ids) - 1:])
    return [tuple(row.topk(2).values.tolist()) for row in logits]


def hf_teacher_forced(model, prompt_ids: list[int],
                      token_ids: list[int]) -> tuple[list[int], list[tuple[float, float]]]:
    """transformers' greedy choice and (best, second) logit before each of `token_ids`, from
    one forward of prompt + tokens. Where `token_ids` are the model's greedy continuation,
    each choice equals the token (by induction: the same prefix, the same argmax), so this
    checks a greedy run as `generate` would, in one forward instead of one per token."""
    ids = torch.tensor([prompt_ids + token_ids[:-1]])
    with torch.no_grad():
        logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, len(prompt_ids) - 1:]
    top = logits.float().topk(2)
    return top.indices[:, 0].tolist(), [tuple(v) for v in top.values.tolist()]
