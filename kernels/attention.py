"""Triton paged attention over a mixed batch: prefill chunks and decodes in one launch.

A program owns one tile of a sequence's query tokens times all query heads that share one KV
head (GQA), so every K/V tile it reads from the pool serves `num_heads // num_kv_heads`
heads at once. Query tiles of all sequences are numbered in one grid axis; a program finds
its sequence by binary search over `query_start_loc`, so the launch needs no host-side copy
of the per-sequence lengths. Causality covers both the cached context and the chunk itself:
query token j of a sequence sits at position seq_len - q_len + j and sees keys up to it.

The torch twin with the same signature is `sluice.kernels.reference.paged_attention`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sluice.kernels import checks

__all__ = ["paged_attention", "launch_paged_attention"]

_LOG2E = 1.4426950408889634


@triton.jit
def _find_sequence(QueryStartLoc, num_seqs, q_tile, BLOCK_Q: tl.constexpr):
    """The last sequence whose first query tile (start // BLOCK_Q + index) is <= q_tile."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(QueryStartLoc + mid) // BLOCK_Q + mid
        if first_tile <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    Out, Query, KeyCache, ValueCache, BlockTables, QueryStartLoc, SeqLens,
    scale_log2,
    num_seqs,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_table,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(QueryStartLoc, num_seqs, q_tile, BLOCK_Q)

    q_start = tl.load(QueryStartLoc + seq).to(tl.int64)
    q_len = (tl.load(QueryStartLoc + seq + 1) - q_start).to(tl.int32)
    local_tile = q_tile - (q_start // BLOCK_Q + seq).to(tl.int32)
    if local_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(SeqLens + seq).to(tl.int32)
    context_before = seq_len - q_len

    # row m of the tile is query token m // QUERIES_PER_KV of the tile, head m % QUERIES_PER_KV
    # of this KV head's group; rows past BLOCK_Q * QUERIES_PER_KV are padding
    rows = tl.arange(0, BLOCK_M)
    q_local = local_tile * BLOCK_Q + rows // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows // QUERIES_PER_KV < BLOCK_Q) & (q_local < q_len)
    query_pos = context_before + q_local
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    token = q_start + q_local.to(tl.int64)
    q_offsets = token[:, None] * stride_qt + head[:, None].to(tl.int64) * stride_qh + dims[None, :]
    q = tl.load(Query + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    # keys past the tile's last query are never visible to it
    keys_needed = tl.minimum(context_before + (local_tile + 1) * BLOCK_Q, seq_len)
    table = BlockTables + seq.to(tl.int64) * stride_table
    key_base = KeyCache + kv_head.to(tl.int64) * stride_kh
    value_base = ValueCache + kv_head.to(tl.int64) * stride_vh

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    cols = tl.arange(0, TILE_N)
    for tile_start in range(0, keys_needed, TILE_N):
        key_pos = tile_start + cols
        key_valid = key_pos < keys_needed
        block_ids = tl.load(table + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        in_block = (key_pos % BLOCK_SIZE).to(tl.int64)

        k_offsets = block_ids[None, :] * stride_kb + in_block[None, :] * stride_kt + dims[:, None]
        k = tl.load(key_base + k_offsets, mask=dim_valid[:, None] & key_valid[None, :],
                    other=0.0)
        if DOT_IN_FP32:
            scores = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            scores = tl.dot(q, k)
        scores = scores * scale_log2
        visible = key_valid[None, :] & (key_pos[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))

        # every row sees key 0 in the first tile, so the running max is finite from then on
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        probs = tl.exp2(scores - new_max[:, None])
        correction = tl.exp2(running_max - new_max)
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None]

        v_offsets = block_ids[:, None] * stride_vb + in_block[:, None] * stride_vt + dims[None, :]
        v = tl.load(value_base + v_offsets, mask=key_valid[:, None] & dim_valid[None, :],
                    other=0.0)
        if DOT_IN_FP32:
            acc += tl.dot(probs, v.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(probs.to(v.dtype), v)
        running_max = new_max

    out = acc / running_sum[:, None]
    o_offsets = token[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh + dims[None, :]
    tl.store(Out + o_offsets, out.to(Out.dtype.element_ty),
             mask=row_valid[:, None] & dim_valid[None, :])


_validated_metadata = checks.ValidatedValues()


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's query tokens over its paged context.

    query [num_tokens, num_heads, head_dim]: the query tokens of sequence i are
    query[query_start_loc[i]:query_start_loc[i+1]], the last ones of its seq_lens[i]-token
    context, whose K/V already sit in the pools [num_blocks, block_size, kv_heads, head_dim].
    block_tables [num_seqs, max_blocks] maps each sequence's logical blocks to pool blocks.
    Returns a new tensor shaped and typed like query.
    """
    check_arguments(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                    scale)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    launch_paged_attention(out, query, key_cache, value_cache, block_tables, query_start_loc,
                           seq_lens, scale)
    return out


def launch_paged_attention(out, query, key_cache, value_cache, block_tables, query_start_loc,
                           seq_lens, scale: float) -> None:
    """Launch the kernel into `out` without checking anything (benchmarks call this)."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    _, block_size, kv_heads, _ = key_cache.shape
    queries_per_kv = num_heads // kv_heads
    # all-decode steps have one query token per sequence: a 16-row tile wastes least there
    base_rows = 16 if num_tokens == num_seqs else 64
    block_m = max(base_rows, triton.next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    grid = (num_tokens // block_q + num_seqs, kv_heads)
    _paged_attention_kernel[grid](
        out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
        scale * _LOG2E,
        num_seqs,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_M=block_m, BLOCK_Q=block_q,
        TILE_N=max(32, block_size) if head_dim <= 128 else 32,
        DOT_IN_FP32=_dot_in_fp32(query.dtype),
    )


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    # fp32 needs IEEE products (no TF32) to match the reference; the CPU interpreter
    # multiplies bf16 bit patterns as integers, so it gets fp32 operands instead
    return dtype == torch.float32 or (dtype == torch.bfloat16 and checks.interpreting())


def check_arguments(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                    scale) -> None:
    """Raise TypeError/ValueError naming the argument the kernel cannot take as given."""
    checks.require_tensor("query", query, 3)
    checks.require_tensor("key_cache", key_cache, 4)
    checks.require_tensor("value_cache", value_cache, 4)
    checks.require_tensor("block_tables", block_tables, 2)
    checks.require_tensor("query_start_loc", query_start_loc, 1)
    checks.require_tensor("seq_lens", seq_lens, 1)
    checks.require_same_device({
        "query": query, "key_cache": key_cache, "value_cache": value_cache,
        "block_tables": block_tables, "query_start_loc": query_start_loc, "seq_lens": seq_lens,
    })

    checks.require_dtype("query", query, checks.FLOAT_DTYPES)
    checks.require_same_dtype("key_cache", key_cache, "query", query)
    checks.require_same_dtype("value_cache", value_cache, "query", query)
    checks.require_dtype("block_tables", block_tables, checks.INDEX_DTYPES)
    checks.require_dtype("query_start_loc", query_start_loc, checks.INDEX_DTYPES)
    checks.require_dtype("seq_lens", seq_lens, checks.INDEX_DTYPES)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) \
            or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")

    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache has shape {tuple(value_cache.shape)} but key_cache has "
                         f"{tuple(key_cache.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, kv_heads, cache_head_dim = key_cache.shape
    if head_dim != cache_head_dim:
        raise ValueError(f"query has head_dim {head_dim} but key_cache has {cache_head_dim}")
    if head_dim > 256:
        raise ValueError(f"query head_dim {head_dim} is larger than the kernel's 256")
    if kv_heads == 0 or num_heads % kv_heads != 0:
        raise ValueError(f"query has {num_heads} heads, not a multiple of key_cache's "
                         f"{kv_heads} KV heads")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"key_cache block_size must be a power of two, got {block_size}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries; "
                         f"seq_lens has {num_seqs} sequences, so it needs {num_seqs + 1}")
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} "
                         "sequences in seq_lens")

    checks.require_unit_inner_stride("query", query)
    checks.require_contiguous("key_cache", key_cache)
    checks.require_contiguous("value_cache", value_cache)
    checks.require_contiguous("block_tables", block_tables)
    checks.require_contiguous("query_start_loc", query_start_loc)
    checks.require_contiguous("seq_lens", seq_lens)

    def validate() -> None:
        _check_metadata_values(block_tables, query_start_loc, seq_lens, num_tokens,
                               num_blocks, block_size)

    _validated_metadata.check([block_tables, query_start_loc, seq_lens],
                              (num_tokens, num_blocks, block_size), validate)


def _check_metadata_values(block_tables, query_start_loc, seq_lens, num_tokens, num_blocks,
                           block_size) -> None:
    """All value checks in one device-to-host copy; the slow hunt for details only on failure."""
    if seq_lens.shape[0] == 0:
        if num_tokens != 0:
            raise ValueError(f"query has {num_tokens} tokens but seq_lens holds no sequence")
        return
    starts = query_start_loc.long()
    lengths = seq_lens.long()
    q_lens = starts[1:] - starts[:-1]
    capacity = block_tables.shape[1] * block_size
    blocks_used = (lengths + block_size - 1) // block_size
    cols = torch.arange(block_tables.shape[1], device=block_tables.device)
    used = cols[None, :] < blocks_used[:, None]
    ids = block_tables.long()
    bad_ids = used & ((ids < 0) | (ids >= num_blocks))
    flags = torch.stack([
        starts[0] != 0,
        starts[-1] != num_tokens,
        (q_lens < 0).any(),
        (lengths < 0).any(),
        (q_lens > lengths).any(),
        (lengths > capacity).any(),
        bad_ids.any(),
    ]).tolist()
    if not any(flags):
        return

    def first(mask: torch.Tensor) -> int:
        return int(mask.nonzero()[0, 0])

    if flags[0]:
        raise ValueError(f"query_start_loc must start at 0, got {int(starts[0])}")
    if flags[1]:
        raise ValueError(f"query_start_loc must end at the query's {num_tokens} tokens, got "
                         f"{int(starts[-1])}")
    if flags[2]:
        raise ValueError(f"query_start_loc must be non-decreasing; it falls after sequence "
                         f"{first(q_lens < 0)}")
    if flags[3]:
        i = first(lengths < 0)
        raise ValueError(f"seq_lens[{i}] is negative ({int(lengths[i])})")
    if flags[4]:
        i = first(q_lens > lengths)
        raise ValueError(f"sequence {i} has {int(q_lens[i])} query tokens but seq_lens[{i}] "
                         f"is only {int(lengths[i])}")
    if flags[5]:
        i = first(lengths > capacity)
        raise ValueError(f"seq_lens[{i}] = {int(lengths[i])} exceeds the {capacity} tokens "
                         f"block_tables can address ({block_tables.shape[1]} blocks of "
                         f"{block_size})")
    row, col = (int(x) for x in bad_ids.nonzero()[0])
    raise ValueError(f"block_tables[{row}, {col}] = {int(ids[row, col])} is outside the pool "
                     f"of {num_blocks} blocks")
