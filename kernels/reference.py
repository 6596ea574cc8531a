"""Pure-torch references for the paged KV kernels, same signatures as the Triton launchers.

These are also what runs on CPU, so they are written to be fast there: decodes of a step are
gathered and attended in one batched call; only prefill chunks go one sequence at a time.
Nothing here imports triton.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.kernels.checks import check_window_and_softcap


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [num_tokens, kv_heads, head_dim] into the pools at `slot_mapping`."""
    num_blocks, block_size, kv_heads, head_dim = key_cache.shape
    flat_keys = key_cache.view(num_blocks * block_size, kv_heads, head_dim)
    flat_values = value_cache.view(num_blocks * block_size, kv_heads, head_dim)
    flat_keys.index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    flat_values.index_copy_(0, slot_mapping, value.to(value_cache.dtype))


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

    query [num_tokens, num_heads, head_dim]; the query tokens of sequence i are
    query[query_start_loc[i]:query_start_loc[i+1]] and are the last ones of its
    seq_lens[i]-token context, whose K/V already sit in the pools (write them first).

    `window` > 0 is a sliding window: the query at position p sees only the keys at positions
    p - window < k <= p. `softcap` > 0 caps the scaled scores as softcap * tanh(s / softcap)
    before the softmax. 0 turns either off.
    """
    check_window_and_softcap(window, softcap)
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    block_size = key_cache.shape[1]
    decodes = [i for i in range(len(lengths)) if starts[i + 1] - starts[i] == 1]
    for group in _length_groups(decodes, lengths):
        _attend_decodes(query, key_cache, value_cache, block_tables, starts, lengths,
                        group, block_size, scale, out, window, softcap)
    for i in range(len(lengths)):
        q_len = starts[i + 1] - starts[i]
        if q_len > 1:
            _attend_chunk(query, key_cache, value_cache, block_tables[i], starts[i], q_len,
                          lengths[i], block_size, scale, out, window, softcap)
    return out


# decodes are padded to the longest context of their group: groups of similar lengths keep
# the padding (gathered and attended for nothing) under about half of the work, while few
# enough groups keep the per-call overhead small
_GROUP_LENGTH_RATIO = 2.0
_MIN_GROUP = 8


def _length_groups(decodes: list[int], lengths: list[int]) -> list[list[int]]:
    groups: list[list[int]] = []
    for i in sorted(decodes, key=lengths.__getitem__):
        group = groups[-1] if groups else None
        if (group is None or (len(group) >= _MIN_GROUP
                              and lengths[i] > _GROUP_LENGTH_RATIO * lengths[group[0]])):
            groups.append([i])
        else:
            group.append(i)
    return groups


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[..., n_blocks] block ids -> [..., n_blocks * block_size, kv_heads, head_dim]."""
    # index_select copies whole blocks at memcpy speed; advanced indexing is ~3x slower here
    # (padding entries may be -1: they are masked out, any real block will do)
    gathered = cache.index_select(0, block_ids.reshape(-1).clamp(min=0))
    return gathered.view(*block_ids.shape[:-1], -1, *cache.shape[2:])


def _attend_decodes(query, key_cache, value_cache, block_tables, starts, lengths, decodes,
                    block_size, scale, out, window=0, softcap=0.0) -> None:
    rows = torch.tensor(decodes, dtype=torch.long)
    token_index = torch.tensor([starts[i] for i in decodes], dtype=torch.long)
    ctx = torch.tensor([lengths[i] for i in decodes], dtype=torch.long)
    max_ctx = int(ctx.max())
    # with a window, the blocks before the group's earliest visible key are not read at all
    first_block = max(0, int(ctx.min()) - window) // block_size if window else 0
    first_key = first_block * block_size
    n_blocks = -(-max_ctx // block_size)
    tables = block_tables[rows, first_block:n_blocks].long()
    keys = _gather(key_cache, tables)[:, :max_ctx - first_key].transpose(1, 2)  # [B, kvh, L, d]
    values = _gather(value_cache, tables)[:, :max_ctx - first_key].transpose(1, 2)
    q = query[token_index].unsqueeze(2)  # [B, H, 1, d]
    key_pos = torch.arange(first_key, max_ctx)[None, :]
    visible = key_pos < ctx[:, None]  # [B, L]
    if window:
        visible &= key_pos >= ctx[:, None] - window  # the query sits at position ctx - 1
    visible = visible.to(query.device)  # built on the host; a no-op for CPU tensors
    if softcap:
        attended = _capped_attention(q.to(keys.dtype), keys, values, visible[:, None, None, :],
                                     scale, softcap)
    else:
        attended = F.scaled_dot_product_attention(
            q.to(keys.dtype), keys, values, attn_mask=visible[:, None, None, :], scale=scale,
            enable_gqa=q.shape[1] != keys.shape[1],
        )
    out[token_index] = attended.squeeze(2).to(out.dtype)


def _attend_chunk(query, key_cache, value_cache, table, start, q_len, ctx_len, block_size,
                  scale, out, window=0, softcap=0.0) -> None:
    first_pos = ctx_len - q_len
    # with a window, the blocks before the chunk's earliest visible key are not read at all
    first_block = max(0, first_pos + 1 - window) // block_size if window else 0
    first_key = first_block * block_size
    n_blocks = -(-ctx_len // block_size)
    ids = table[first_block:n_blocks].long()
    keys = _gather(key_cache, ids)[:ctx_len - first_key].transpose(0, 1)[None]  # [1, kvh, L, d]
    values = _gather(value_cache, ids)[:ctx_len - first_key].transpose(0, 1)[None]
    q = query[start:start + q_len].transpose(0, 1)[None]  # [1, H, q, d]
    if first_pos == 0 and not window:
        # a chunk with no cached context is plain causal attention: no mask to build or read
        mask, causal = None, True
    else:
        query_pos = torch.arange(first_pos, ctx_len, device=query.device)[:, None]
        key_pos = torch.arange(first_key, ctx_len, device=query.device)[None, :]
        mask, causal = key_pos <= query_pos, False
        if window:
            mask &= key_pos > query_pos - window
    if softcap:
        if mask is None:
            mask = torch.ones(q_len, ctx_len, dtype=torch.bool, device=query.device).tril()
        attended = _capped_attention(q.to(keys.dtype), keys, values, mask, scale, softcap)
    else:
        attended = F.scaled_dot_product_attention(
            q.to(keys.dtype), keys, values, attn_mask=mask, is_causal=causal, scale=scale,
            enable_gqa=q.shape[1] != keys.shape[1],
        )
    out[start:start + q_len] = attended[0].transpose(0, 1).to(out.dtype)


def _capped_attention(q, keys, values, mask, scale, softcap) -> torch.Tensor:
    """SDPA with soft-capped scores (SDPA has no cap): q [B, H, q, d], keys/values
    [B, kvh, L, d], mask broadcastable to [B, H, q, L] (True: visible). Computed in fp32."""
    group = q.shape[1] // keys.shape[1]
    if group > 1:
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values.float()).to(q.dtype)


def paged_attention_fixed_order(
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
    """`paged_attention` with each query token attended on its own, over exactly the keys it
    sees, in float32: no batched or padded call whose shape (and so reduction order) follows
    the other sequences of the step or the chunk the token came in, so a token's output
    depends only on its query and its keys. The deterministic mode's attention where the CPU
    op cannot be built; slow (a few small ops per query token), never the default."""
    check_window_and_softcap(window, softcap)
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    block_size = key_cache.shape[1]
    kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    group = query.shape[1] // kv_heads
    for i, ctx_len in enumerate(lengths):
        q_len = starts[i + 1] - starts[i]
        if q_len == 0:
            continue
        ids = block_tables[i, :-(-ctx_len // block_size)].long()
        # [kv_heads, ctx, head_dim] in float32: copies of the pool's values, exact
        keys = _gather(key_cache, ids)[:ctx_len].transpose(0, 1).float()
        values = _gather(value_cache, ids)[:ctx_len].transpose(0, 1).float()
        for t in range(q_len):
            pos = ctx_len - q_len + t
            lo = max(0, pos - window + 1) if window else 0
            q = query[starts[i] + t].to(key_cache.dtype).float().view(kv_heads, group, 1,
                                                                       head_dim)
            k = keys[:, None, lo:pos + 1]  # [kv_heads, 1, L, head_dim]
            scores = (q * scale * k).sum(-1)  # [kv_heads, group, L]
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            probs = torch.softmax(scores, dim=-1)
            attended = (probs[..., None] * values[:, None, lo:pos + 1]).sum(-2)
            out[starts[i] + t] = attended.reshape(-1, head_dim).to(out.dtype)
    return out
