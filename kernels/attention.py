"""Triton paged attention over a mixed batch: prefill chunks and decodes in one launch.

A program owns one tile of a sequence's query tokens times all query heads that share one KV
head (GQA), so every K/V tile it reads from the pool serves `num_heads // num_kv_heads`
heads at once. Query tiles of all sequences are numbered in one grid axis; a program finds
its sequence by binary search over `query_start_loc`, so the launch needs no host-side copy
of the per-sequence lengths. Causality covers both the cached context and the chunk itself:
query token j of a sequence sits at position seq_len - q_len + j and sees keys up to it.

A sliding window (`window` > 0: position p sees keys p - window < k <= p) and a soft cap on
the scores (`softcap` > 0: s -> softcap * tanh(s / softcap)) are compile-time switches: off,
the kernel is the one without them. With a window a program starts at the window of its
tile's first query, so key tiles wholly before it are never read.

The torch twin with the same signature is `sluice.kernels.reference.paged_attention`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels import checks

__all__ = ["paged_attention", "launch_paged_attention", "choose_num_splits"]

_LOG2E = 1.4426950408889634


# num_seqs is a loop bound of the binary search: never let a batch of one make it a constant
@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    Out, PartialOut, PartialMax, PartialSum,
    Query, KeyCache, ValueCache, BlockTables, QueryStartLoc, SeqLens,
    scale_log2,
    window, softcap_scale, softcap_log2,
    num_seqs,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_pt, stride_ph,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_table,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr,
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # binary search for the last sequence whose first query tile (start // BLOCK_Q + index)
    # is <= q_tile; inline, since the interpreter pays dearly for every nested jit call
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(QueryStartLoc + mid) // BLOCK_Q + mid <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1

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
    # with NUM_SPLITS > 1 each program takes one contiguous share of the key tiles
    if USE_WINDOW:
        # nor are keys before the window of the tile's first query: those are never read
        keys_start = tl.maximum(context_before + local_tile * BLOCK_Q - window + 1, 0)
        tiles = (keys_needed - keys_start + TILE_N - 1) // TILE_N
        tiles_per_split = (tiles + NUM_SPLITS - 1) // NUM_SPLITS
        keys_from = keys_start + split * tiles_per_split * TILE_N
    else:
        tiles = (keys_needed + TILE_N - 1) // TILE_N
        tiles_per_split = (tiles + NUM_SPLITS - 1) // NUM_SPLITS
        keys_from = split * tiles_per_split * TILE_N
    keys_to = tl.minimum(keys_from + tiles_per_split * TILE_N, keys_needed)
    table = BlockTables + seq.to(tl.int64) * stride_table
    key_base = KeyCache + kv_head.to(tl.int64) * stride_kh
    value_base = ValueCache + kv_head.to(tl.int64) * stride_vh

    running_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    cols = tl.arange(0, TILE_N)
    for tile_start in range(keys_from, keys_to, TILE_N):
        key_pos = tile_start + cols
        key_valid = key_pos < keys_to
        block_ids = tl.load(table + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        in_block = (key_pos % BLOCK_SIZE).to(tl.int64)

        k_offsets = block_ids[None, :] * stride_kb + in_block[None, :] * stride_kt + dims[:, None]
        k = tl.load(key_base + k_offsets, mask=dim_valid[:, None] & key_valid[None, :],
                    other=0.0)
        if DOT_IN_FP32:
            scores = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            scores = tl.dot(q, k)
        if USE_SOFTCAP:
            # softcap * tanh(scale * s / softcap), in log2 units as the softmax runs on exp2;
            # tanh(|x|) = (1 - e) / (1 + e) with e = exp(-2|x|) <= 1, which never overflows
            capped = scores * softcap_scale
            e = tl.exp2(tl.abs(capped) * -2.8853900817779268)  # -2 * log2(e)
            tanh_abs = (1.0 - e) / (1.0 + e)
            scores = tl.where(capped < 0, -tanh_abs, tanh_abs) * softcap_log2
        else:
            scores = scores * scale_log2
        visible = key_valid[None, :] & (key_pos[None, :] <= query_pos[:, None])
        if USE_WINDOW:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))

        # a row that has seen no visible key yet keeps max -inf; subtract 0 then, not -inf
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp2(scores - shift[:, None])
        correction = tl.exp2(running_max - shift)
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

    store_mask = row_valid[:, None] & dim_valid[None, :]
    if USE_WINDOW:
        # a padding row past the chunk's end may have no key in its window: no 0 / 0 for it
        running_sum = tl.where(row_valid, running_sum, 1.0)
    if NUM_SPLITS == 1:
        out = acc / running_sum[:, None]
        o_offsets = (token[:, None] * stride_ot + head[:, None].to(tl.int64) * stride_oh
                     + dims[None, :])
        tl.store(Out + o_offsets, out.to(Out.dtype.element_ty), mask=store_mask)
    else:
        # partials [token, head, split, ...]: unnormalised acc, and its max and sum
        row = token * stride_pt + head.to(tl.int64) * stride_ph + split
        tl.store(PartialMax + row, running_max, mask=row_valid)
        tl.store(PartialSum + row, running_sum, mask=row_valid)
        tl.store(PartialOut + row[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=store_mask)


@triton.jit
def _merge_splits_kernel(
    Out, PartialOut, PartialMax, PartialSum,
    stride_ot, stride_oh,
    stride_pt, stride_ph,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    row = token * stride_pt + head * stride_ph + splits
    split_valid = splits < NUM_SPLITS
    maxes = tl.load(PartialMax + row, mask=split_valid, other=float("-inf"))
    sums = tl.load(PartialSum + row, mask=split_valid, other=0.0)
    accs = tl.load(PartialOut + row[:, None] * HEAD_DIM_PAD + dims[None, :],
                   mask=split_valid[:, None], other=0.0)
    # every row sees its own key in one of the splits, so the overall max is finite
    overall = tl.max(maxes, axis=0)
    weights = tl.exp2(maxes - overall)
    total = tl.sum(sums * weights, axis=0)
    out = tl.sum(accs * weights[:, None], axis=0) / total
    tl.store(Out + token * stride_ot + head * stride_oh + dims, out.to(Out.dtype.element_ty),
             mask=dims < HEAD_DIM)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each sequence's query tokens over its paged context.

    query [num_tokens, num_heads, head_dim]: the query tokens of sequence i are
    query[query_start_loc[i]:query_start_loc[i+1]], the last ones of its seq_lens[i]-token
    context, whose K/V already sit in the pools [num_blocks, block_size, kv_heads, head_dim].
    block_tables [num_seqs, max_blocks] maps each sequence's logical blocks to pool blocks.
    `window` > 0: the query at position p sees only keys p - window < k <= p; `softcap` > 0:
    scaled scores become softcap * tanh(scores / softcap). 0 turns either off.
    Returns a new tensor shaped and typed like query.
    """
    checks.check_attention_arguments(query, key_cache, value_cache, block_tables,
                                     query_start_loc, seq_lens, scale)
    checks.check_window_and_softcap(window, softcap)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    with checks.on_device(query):
        launch_paged_attention(out, query, key_cache, value_cache, block_tables,
                               query_start_loc, seq_lens, scale, window=window,
                               softcap=softcap)
    return out


def launch_paged_attention(out, query, key_cache, value_cache, block_tables, query_start_loc,
                           seq_lens, scale: float, num_splits: int | None = None, *,
                           window: int = 0, softcap: float = 0.0) -> None:
    """Launch into `out` without checking anything (benchmarks and tests call this).

    `num_splits` > 1 divides each sequence's keys among that many programs and merges their
    partial softmaxes in a second kernel; None picks it from the batch and the device.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    _, block_size, kv_heads, _ = key_cache.shape
    queries_per_kv = num_heads // kv_heads
    all_decodes = num_tokens == num_seqs  # then every sequence has exactly one query token
    # a decode fills one row per head of the group: a 16-row tile wastes least there
    block_m = max(16 if all_decodes else 64, triton.next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    if num_splits is None:
        num_splits = choose_num_splits(query.device, num_seqs * kv_heads) if all_decodes else 1
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        partial_out = torch.empty((num_tokens, num_heads, num_splits, head_dim_pad),
                                  dtype=torch.float32, device=query.device)
        partial_max = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32,
                                  device=query.device)
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_out = partial_max = partial_sum = out  # never touched
    grid = (num_tokens // block_q + num_seqs, kv_heads, num_splits)
    _paged_attention_kernel[grid](
        out, partial_out, partial_max, partial_sum,
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
        scale * _LOG2E,
        window, scale / softcap if softcap else 0.0, softcap * _LOG2E,
        num_seqs,
        query.stride(0), query.stride(1),
        out.stride(0), out.stride(1),
        num_heads * num_splits, num_splits,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_M=block_m, BLOCK_Q=block_q,
        TILE_N=max(32, block_size) if head_dim <= 128 else 32,
        NUM_SPLITS=num_splits,
        DOT_IN_FP32=_dot_in_fp32(query.dtype),
        USE_WINDOW=window > 0, USE_SOFTCAP=softcap > 0,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, partial_out, partial_max, partial_sum,
            out.stride(0), out.stride(1),
            num_heads * num_splits, num_splits,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
        )


MAX_SPLITS = 16
_sm_counts: dict[int, int] = {}


def choose_num_splits(device: torch.device, programs: int) -> int:
    """Enough key splits for a small decode batch to cover every SM about twice over."""
    if device.type != "cuda":
        return 1  # the interpreter gains nothing from splitting
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    wanted = -(-2 * _sm_counts[index] // programs)
    return 1 if wanted <= 1 else min(MAX_SPLITS, triton.next_power_of_2(wanted))


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    # fp32 needs IEEE products (no TF32) to match the reference; the CPU interpreter
    # multiplies bf16 bit patterns as integers, so it gets fp32 operands instead
    return dtype == torch.float32 or (dtype == torch.bfloat16 and checks.interpreting())
