"""Paged KV kernels: the dispatch between Triton (CUDA) and the torch references (CPU).

`SLUICE_ATTENTION=triton|torch` overrides the choice, for tests and debugging. The Triton
modules are imported only when chosen, so CPU users never import triton.
"""

from __future__ import annotations

import os

import torch

from sluice.kernels import reference

__all__ = ["paged_attention", "reshape_and_cache", "backend_for"]


def backend_for(tensor: torch.Tensor) -> str:
    override = os.environ.get("SLUICE_ATTENTION", "").strip().lower()
    if override in ("triton", "torch"):
        return override
    if override:
        raise ValueError(f"SLUICE_ATTENTION must be 'triton' or 'torch', got {override!r}")
    return "triton" if tensor.is_cuda else "torch"


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    if backend_for(key) == "triton":
        from sluice.kernels.cache import reshape_and_cache as launch

        return launch(key, value, key_cache, value_cache, slot_mapping)
    return reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                    scale: float) -> torch.Tensor:
    if backend_for(query) == "triton":
        from sluice.kernels.attention import paged_attention as launch

        return launch(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                      scale)
    return reference.paged_attention(query, key_cache, value_cache, block_tables,
                                     query_start_loc, seq_lens, scale)
