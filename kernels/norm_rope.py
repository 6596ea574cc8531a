"""Triton kernels for the small per-token steps around attention: RMSNorm (optionally fused
with the residual add) and the rotary embedding of q and k in one launch.

On a GPU each of these is one kernel instead of the handful of elementwise kernels torch
launches, which matters most for small decode batches. Their torch twins, with the same
signatures, are in `norm_rope_reference.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels import checks

__all__ = ["rms_norm", "add_rms_norm", "rotary_embedding"]

MAX_HIDDEN = 16_384
_validated_positions = checks.ValidatedValues()


@triton.jit
def _rms_norm_kernel(
    Out, Summed, X, Residual, Weight,
    stride_out, stride_summed, stride_x, stride_residual,
    hidden, eps,
    BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < hidden
    x = tl.load(X + token * stride_x + cols, mask=valid, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(Residual + token * stride_residual + cols, mask=valid, other=0.0)
        # rounded to the activation dtype, as torch's `x + residual` would be
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(Summed + token * stride_summed + cols, x, mask=valid)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    normed = (x32 * inv_rms).to(X.dtype.element_ty)
    weight = tl.load(Weight + cols, mask=valid, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(Out + token * stride_out + cols, out.to(Out.dtype.element_ty), mask=valid)


@triton.jit
def _rotary_kernel(
    QueryOut, KeyOut, Query, Key, Positions, Cos, Sin,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_table,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(Positions + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF_PAD)
    dim_valid = dims < HALF
    cos_lo = tl.load(Cos + position * stride_table + dims, mask=dim_valid, other=0.0)
    cos_hi = tl.load(Cos + position * stride_table + HALF + dims, mask=dim_valid, other=0.0)
    sin_lo = tl.load(Sin + position * stride_table + dims, mask=dim_valid, other=0.0)
    sin_hi = tl.load(Sin + position * stride_table + HALF + dims, mask=dim_valid, other=0.0)
    cos_lo, cos_hi = cos_lo.to(tl.float32)[None, :], cos_hi.to(tl.float32)[None, :]
    sin_lo, sin_hi = sin_lo.to(tl.float32)[None, :], sin_hi.to(tl.float32)[None, :]

    mask = (heads[:, None] < NUM_HEADS) & dim_valid[None, :]
    src = Query + token * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    lo = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = QueryOut + token * stride_qot + heads[:, None] * stride_qoh + dims[None, :]
    tl.store(dst, (lo * cos_lo - hi * sin_lo).to(QueryOut.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (hi * cos_hi + lo * sin_hi).to(QueryOut.dtype.element_ty), mask=mask)

    mask = (heads[:, None] < NUM_KV_HEADS) & dim_valid[None, :]
    src = Key + token * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    lo = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = KeyOut + token * stride_kot + heads[:, None] * stride_koh + dims[None, :]
    tl.store(dst, (lo * cos_lo - hi * sin_lo).to(KeyOut.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (hi * cos_hi + lo * sin_hi).to(KeyOut.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [num_tokens, hidden] normalised by its root mean square, times weight [hidden]."""
    _check_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    _launch_norm(out, out, x, x, weight, eps, add_residual=False)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream and the next layer's input."""
    _check_norm(x, weight, eps)
    checks.require_tensor("residual", residual, 2)
    checks.require_same_device({"x": x, "residual": residual})
    checks.require_same_dtype("residual", residual, "x", x)
    checks.require_unit_inner_stride("residual", residual)
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)} but x has "
                         f"{tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch_norm(out, summed, x, residual, weight, eps, add_residual=True)
    return out, summed


def _launch_norm(out, summed, x, residual, weight, eps, *, add_residual: bool) -> None:
    if x.shape[0] == 0:
        return
    hidden = x.shape[1]
    block = triton.next_power_of_2(hidden)
    with checks.on_device(x):
        _rms_norm_kernel[(x.shape[0],)](
            out, summed, x, residual, weight,
            out.stride(0), summed.stride(0), x.stride(0), residual.stride(0),
            hidden, float(eps),
            BLOCK=block, ADD_RESIDUAL=add_residual,
            num_warps=min(16, max(1, block // 512)),
        )


def _check_norm(x, weight, eps) -> None:
    checks.require_tensor("x", x, 2)
    checks.require_tensor("weight", weight, 1)
    checks.require_same_device({"x": x, "weight": weight})
    checks.require_dtype("x", x, checks.FLOAT_DTYPES)
    checks.require_dtype("weight", weight, checks.FLOAT_DTYPES)
    checks.require_unit_inner_stride("x", x)
    checks.require_contiguous("weight", weight)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight has {weight.shape[0]} entries but x has hidden size "
                         f"{x.shape[1]}")
    if x.shape[1] > MAX_HIDDEN:
        raise ValueError(f"x hidden size {x.shape[1]} is larger than the kernel's {MAX_HIDDEN}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")


def rotary_embedding(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [num_tokens, heads, head_dim] and key [num_tokens, kv_heads, head_dim] rotated
    ("rotate half" layout) by cos/sin [max_positions, head_dim] at each token's position;
    returns new contiguous tensors. q and k may be views into a fused qkv projection."""
    checks.require_tensor("query", query, 3)
    checks.require_tensor("key", key, 3)
    checks.require_tensor("positions", positions, 1)
    checks.require_tensor("cos", cos, 2)
    checks.require_tensor("sin", sin, 2)
    checks.require_same_device({"query": query, "key": key, "positions": positions,
                                "cos": cos, "sin": sin})
    checks.require_dtype("query", query, checks.FLOAT_DTYPES)
    checks.require_same_dtype("key", key, "query", query)
    checks.require_dtype("cos", cos, checks.FLOAT_DTYPES)
    checks.require_same_dtype("sin", sin, "cos", cos)
    checks.require_dtype("positions", positions, checks.INDEX_DTYPES)
    for name, tensor in (("query", query), ("key", key)):
        checks.require_unit_inner_stride(name, tensor)
    checks.require_contiguous("cos", cos)
    checks.require_contiguous("sin", sin)
    checks.require_contiguous("positions", positions)
    num_tokens, num_heads, head_dim = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(f"key has shape {tuple(key.shape)}; query {tuple(query.shape)} needs "
                         f"[{num_tokens}, kv_heads, {head_dim}]")
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions has {positions.shape[0]} entries for {num_tokens} tokens")
    if cos.shape != sin.shape or cos.shape[1] != head_dim:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be "
                         f"[max_positions, {head_dim}]")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for the rotary embedding, got {head_dim}")
    table_len = cos.shape[0]

    def validate() -> None:
        if num_tokens == 0:
            return
        low, high = torch.stack(list(torch.aminmax(positions))).tolist()
        if low < 0 or high >= table_len:
            raise ValueError(f"positions must lie in [0, {table_len}), the rotary tables' "
                             f"length; got {low if low < 0 else high}")

    # every layer rotates with the same positions: their range is checked once per step
    _validated_positions.check([positions], (table_len,), validate)

    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return query_out, key_out
    half = head_dim // 2
    with checks.on_device(query):
        _rotary_kernel[(num_tokens,)](
            query_out, key_out, query, key, positions, cos, sin,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            query_out.stride(0), query_out.stride(1), key_out.stride(0), key_out.stride(1),
            cos.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=key.shape[1],
            HEADS_PAD=triton.next_power_of_2(max(num_heads, key.shape[1])),
            HALF=half, HALF_PAD=triton.next_power_of_2(half),
        )
    return query_out, key_out
