"""Which part of a model each rank of a tensor-parallel group holds: plain arithmetic on a
`ModelConfig`, no torch, so the daemon (which never runs a model) checks a group's size
before any process starts. `tensor_parallel.py` cuts the weights by these shares.

Attention is split by KV head, with the query heads that read each one. When a model has at
least as many KV heads as ranks, the KV heads are dealt out as evenly as they go (SmolLM2's
3 KV heads over 2 ranks: 2 and 1, with 6 and 3 of its 9 query heads): the ranks then do
unequal work, but every size up to the KV-head count is possible. With fewer KV heads than
ranks, each KV head is replicated on `N / kv` ranks that split its query heads evenly, so N
must be a multiple of the KV heads and divide the query heads. The MLP's intermediate size
(and each expert's) is split as evenly as it goes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sluice.actors.executor.config import ModelConfig


class TensorParallelError(ValueError):
    """A tensor-parallel size the model cannot be split by, or a group that failed."""


@dataclass(frozen=True)
class RankShare:
    """One rank's part of the model, as ranges over the whole model's indices."""

    q_heads: range
    kv_heads: range
    intermediate: range
    expert_intermediate: range


def _check_size(tensor_parallel: object) -> int:
    n = tensor_parallel
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise TensorParallelError(f"tensor_parallel must be a whole number ≥ 1, not {n!r}")
    return n


def _heads_split(heads: int, kv: int, n: int) -> bool:
    return n <= kv or (n % kv == 0 and heads % n == 0)


def check_tensor_parallel(config: ModelConfig | None, tensor_parallel: int) -> None:
    """Refuse a `tensor_parallel` the model's shapes cannot be split by, naming the reason
    (without a config: only one that is not a size at all)."""
    n = _check_size(tensor_parallel)
    if n == 1 or config is None:
        return
    heads, kv = config.num_heads, config.num_kv_heads
    if not _heads_split(heads, kv, n):
        choices = [d for d in range(1, heads + 1) if _heads_split(heads, kv, d)]
        raise TensorParallelError(
            f"tensor_parallel = {n} cannot split the model's {heads} attention heads "
            f"({kv} KV heads): it must be at most {kv}, or a multiple of {kv} that divides "
            f"{heads} (tensor_parallel must be one of {', '.join(map(str, choices))})")
    dense = any(not config.is_moe_layer(i) for i in range(config.num_layers))
    if dense and config.intermediate_size < n:
        raise TensorParallelError(
            f"tensor_parallel = {n} is more than the model's intermediate size "
            f"{config.intermediate_size}")
    if config.num_experts and config.moe_intermediate_size < n:
        raise TensorParallelError(
            f"tensor_parallel = {n} is more than the model's expert intermediate size "
            f"{config.moe_intermediate_size}")


def _even(size: int, n: int, rank: int) -> range:
    """Rank `rank`'s part of `size` things dealt out to `n` ranks as evenly as they go."""
    return range(rank * size // n, (rank + 1) * size // n)


def rank_shares(config: ModelConfig, tensor_parallel: int) -> list[RankShare]:
    """Each rank's share of heads and intermediate sizes, rank 0 first (no rank holds more KV
    heads than rank 0: a group's pool is sized by rank 0's blocks)."""
    check_tensor_parallel(config, tensor_parallel)
    n = tensor_parallel
    heads, kv = config.num_heads, config.num_kv_heads
    shares = []
    for rank in range(n):
        if n <= kv:
            # KV heads dealt out, the first `kv % n` ranks one more: ranges that start late
            kv_range = range(rank * (kv // n) + min(rank, kv % n),
                             (rank + 1) * (kv // n) + min(rank + 1, kv % n))
            group = heads // kv
            q_range = range(kv_range.start * group, kv_range.stop * group)
        else:  # fewer KV heads than ranks: each replicated on n / kv ranks
            q_range = _even(heads, n, rank)
            kv_first = rank // (n // kv)
            kv_range = range(kv_first, kv_first + 1)
        shares.append(RankShare(q_range, kv_range,
                                _even(config.intermediate_size, n, rank),
                                _even(config.moe_intermediate_size, n, rank)))
    return shares


def rank_config(config: ModelConfig, rank: int, tensor_parallel: int) -> ModelConfig:
    """The config of rank `rank`'s shard: its share of heads and intermediate sizes."""
    n = _check_size(tensor_parallel)
    if not 0 <= rank < n:
        raise TensorParallelError(f"rank {rank} is outside a tensor_parallel group of {n}")
    if n == 1:
        check_tensor_parallel(config, n)
        return config
    share = rank_shares(config, n)[rank]
    return dataclasses.replace(
        config,
        num_heads=len(share.q_heads),
        num_kv_heads=len(share.kv_heads),
        intermediate_size=len(share.intermediate),
        moe_intermediate_size=len(share.expert_intermediate),
        # lm_head is this rank's vocabulary rows, never the (whole) embedding
        tie_word_embeddings=False,
        # the scale stays the whole model's (it depends on head_dim only, which is unchanged)
    )


def vocab_shard_rows(vocab_size: int, tensor_parallel: int) -> int:
    """Rows of lm_head each rank holds: the vocabulary padded up to a multiple of N, split."""
    return -(-vocab_size // tensor_parallel)
