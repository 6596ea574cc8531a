"""Paged KV kernels: the dispatch between Triton (CUDA), the CPU backend that reads the paged
pool in place (`cpu_paged`, a C++ op built at first use) and the torch references.

On CPU the in-place backend runs where it could be built, else the reference (the reason is
logged once). `SLUICE_ATTENTION=triton|cpu|torch` overrides the choice, for tests and
debugging (`torch` is the reference). The Triton modules are imported only when chosen, so
CPU users never import triton.

`fixed_order=True` (the engine's deterministic mode) asks for attention whose every query
row is reduced in an order fixed by its own position alone, not by the batch, the chunk or
the cached prefix: the CPU op in its fixed-order mode, else the reference's per-token
`paged_attention_fixed_order`. The Triton kernel has no such mode yet: it is refused.
"""

from __future__ import annotations

import os

import torch

from sluice.kernels import cpu_paged, reference

__all__ = ["paged_attention", "reshape_and_cache", "backend_for"]


def backend_for(tensor: torch.Tensor) -> str:
    override = os.environ.get("SLUICE_ATTENTION", "").strip().lower()
    if override in ("triton", "torch"):
        return override
    if override and override != "cpu":
        raise ValueError(f"SLUICE_ATTENTION must be 'triton', 'cpu' or 'torch', got {override!r}")
    if tensor.is_cuda and not override:
        return "triton"
    return "cpu" if cpu_paged.available() else "torch"


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    backend = backend_for(key)
    if backend == "triton":
        from sluice.kernels.cache import reshape_and_cache as launch

        return launch(key, value, key_cache, value_cache, slot_mapping)
    if backend == "cpu" and key.dtype == value.dtype == key_cache.dtype:
        return cpu_paged.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    return reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                    scale: float, *, window: int = 0, softcap: float = 0.0,
                    fixed_order: bool = False) -> torch.Tensor:
    """Causal attention of each sequence's query tokens over its paged context, on the backend
    `backend_for` picks (see `reference.paged_attention` for the arguments). `window` > 0: a
    query at position p sees only keys p - window < k <= p; `softcap` > 0: scaled scores
    become softcap * tanh(scores / softcap) before the softmax. 0 turns either off."""
    backend = backend_for(query)
    if fixed_order:
        if backend == "triton":
            raise ValueError("fixed-order (deterministic) attention runs on the CPU backends "
                             "only; the Triton kernel has no fixed-order mode")
        if backend == "cpu":
            return cpu_paged.paged_attention(query, key_cache, value_cache, block_tables,
                                             query_start_loc, seq_lens, scale, window=window,
                                             softcap=softcap, fixed_order=True)
        return reference.paged_attention_fixed_order(query, key_cache, value_cache,
                                                     block_tables, query_start_loc, seq_lens,
                                                     scale, window=window, softcap=softcap)
    if backend == "triton":
        from sluice.kernels.attention import paged_attention as launch

        return launch(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                      scale, window=window, softcap=softcap)
    if backend == "cpu":
        return cpu_paged.paged_attention(query, key_cache, value_cache, block_tables,
                                         query_start_loc, seq_lens, scale, window=window,
                                         softcap=softcap)
    return reference.paged_attention(query, key_cache, value_cache, block_tables,
                                     query_start_loc, seq_lens, scale, window=window,
                                     softcap=softcap)
