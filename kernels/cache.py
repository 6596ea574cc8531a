"""Triton kernel that writes a step's new K/V rows into the paged KV pool.

The torch twin with the same signature is `sluice.kernels.reference.reshape_and_cache`;
the choice between them is made in `sluice.kernels`, not here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels import checks

__all__ = ["reshape_and_cache"]


@triton.jit
def _reshape_and_cache_kernel(
    Key, Value, KeyCache, ValueCache, SlotMapping,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(SlotMapping + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

    key = tl.load(Key + token * stride_kt + heads[:, None] * stride_kh + dims[None, :],
                  mask=mask, other=0.0)
    value = tl.load(Value + token * stride_vt + heads[:, None] * stride_vh + dims[None, :],
                    mask=mask, other=0.0)
    key_dst = (KeyCache + block * stride_kcb + offset * stride_kct
               + heads[:, None] * stride_kch + dims[None, :])
    value_dst = (ValueCache + block * stride_vcb + offset * stride_vct
                 + heads[:, None] * stride_vch + dims[None, :])
    tl.store(key_dst, key.to(KeyCache.dtype.element_ty), mask=mask)
    tl.store(value_dst, value.to(ValueCache.dtype.element_ty), mask=mask)


_validated_slots = checks.ValidatedValues()


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [num_tokens, kv_heads, head_dim] into the pools at `slot_mapping`.

    Caches are [num_blocks, block_size, kv_heads, head_dim]; slot = block * block_size +
    offset, int64, one per token. Keys are cast to the cache dtype on the way in.
    """
    _check(key, value, key_cache, value_cache, slot_mapping)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, block_size, kv_heads, head_dim = key_cache.shape
    with checks.on_device(key):
        _reshape_and_cache_kernel[(num_tokens,)](
            key, value, key_cache, value_cache, slot_mapping,
            key.stride(0), key.stride(1),
            value.stride(0), value.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
            HEADS_PAD=triton.next_power_of_2(kv_heads),
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=block_size,
        )


def _check(key, value, key_cache, value_cache, slot_mapping) -> None:
    checks.require_tensor("key", key, 3)
    checks.require_tensor("value", value, 3)
    checks.require_tensor("key_cache", key_cache, 4)
    checks.require_tensor("value_cache", value_cache, 4)
    checks.require_tensor("slot_mapping", slot_mapping, 1)
    checks.require_same_device({"key": key, "value": value, "key_cache": key_cache,
                                "value_cache": value_cache, "slot_mapping": slot_mapping})

    checks.require_dtype("key", key, checks.FLOAT_DTYPES)
    checks.require_same_dtype("value", value, "key", key)
    checks.require_dtype("key_cache", key_cache, checks.FLOAT_DTYPES)
    checks.require_same_dtype("value_cache", value_cache, "key_cache", key_cache)
    checks.require_dtype("slot_mapping", slot_mapping, (torch.int64,))

    if value.shape != key.shape:
        raise ValueError(f"value has shape {tuple(value.shape)} but key has {tuple(key.shape)}")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache has shape {tuple(value_cache.shape)} but key_cache has "
                         f"{tuple(key_cache.shape)}")
    num_blocks, block_size, kv_heads, head_dim = key_cache.shape
    if key.shape[1] != kv_heads:
        raise ValueError(f"key has {key.shape[1]} KV heads but key_cache has {kv_heads}")
    if key.shape[2] != head_dim:
        raise ValueError(f"key has head_dim {key.shape[2]} but key_cache has {head_dim}")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for "
                         f"{key.shape[0]} tokens in key")

    checks.require_unit_inner_stride("key", key)
    checks.require_unit_inner_stride("value", value)
    checks.require_contiguous("key_cache", key_cache)
    checks.require_contiguous("value_cache", value_cache)
    checks.require_contiguous("slot_mapping", slot_mapping)

    num_slots = num_blocks * block_size

    def validate() -> None:
        if slot_mapping.numel() == 0:
            return
        low, high = torch.aminmax(slot_mapping)
        low, high = torch.stack([low, high]).tolist()
        if low < 0 or high >= num_slots:
            bad = int(slot_mapping[(slot_mapping < 0) | (slot_mapping >= num_slots)][0])
            raise ValueError(f"slot_mapping holds slot {bad}, outside the pool's "
                             f"{num_slots} slots ({num_blocks} blocks of {block_size})")

    _validated_slots.check([slot_mapping], (num_slots,), validate)
