"""Random paged batches and the parity grid that the kernel tests and the GPU check share.

Building the batches here (not in a test file) lets `benchmarks/gpu_check.py` run exactly the
grid the CPU tests run, on CUDA and in fp16/bf16. Nothing here imports triton.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# the context lengths every parity case is built from: below, at and past block boundaries
SEQ_LENS = (1, 15, 16, 17, 33, 100)
# (num_heads, num_kv_heads): GQA ratios 1, 3 and 8
HEAD_LAYOUTS = ((2, 2), (6, 2), (8, 1))
BLOCK_SIZES = (16, 32)
LARGE_POOL_BLOCKS = 32_768


@dataclass(frozen=True)
class BatchShape:
    """One step's batch: per sequence its context length after the step and its query length."""

    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int = 64
    block_size: int = 16
    num_blocks: int | None = None  # None: the blocks the batch needs plus a few spare
    high_block_ids: bool = False  # take block ids from the top of the pool

    @property
    def name(self) -> str:
        kind = ("decode" if all(q == 1 for q in self.query_lens)
                else "prefill" if self.query_lens == self.seq_lens else "mixed")
        pool = f"-pool{self.num_blocks}" if self.num_blocks else ""
        return (f"{kind}-h{self.num_heads}kv{self.num_kv_heads}-d{self.head_dim}"
                f"-bs{self.block_size}{pool}")


@dataclass
class PagedBatch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    scale: float

    def attention_args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables,
                self.query_start_loc, self.seq_lens, self.scale)


def decode_shape(heads: tuple[int, int], block_size: int = 16, head_dim: int = 64) -> BatchShape:
    return BatchShape(SEQ_LENS, (1,) * len(SEQ_LENS), *heads, head_dim, block_size)


def prefill_shape(heads: tuple[int, int], block_size: int = 16,
                  head_dim: int = 64) -> BatchShape:
    return BatchShape(SEQ_LENS, SEQ_LENS, *heads, head_dim, block_size)


def mixed_shape(heads: tuple[int, int], block_size: int = 16, head_dim: int = 64,
                **extra) -> BatchShape:
    """Prefill chunks that start mid-sequence (at 70, 16, 1 and 0) between decodes."""
    return BatchShape((100, 15, 33, 17, 16, 1, 40), (30, 1, 17, 1, 15, 1, 40), *heads,
                      head_dim, block_size, **extra)


def parity_grid() -> list[BatchShape]:
    """Every batch shape a kernel must match its reference on."""
    grid = []
    for block_size in BLOCK_SIZES:
        for heads in HEAD_LAYOUTS:
            grid += [decode_shape(heads, block_size), prefill_shape(heads, block_size),
                     mixed_shape(heads, block_size)]
    grid.append(mixed_shape((6, 2), 16, head_dim=128))
    grid.append(mixed_shape((8, 1), 16, num_blocks=LARGE_POOL_BLOCKS, high_block_ids=True))
    return grid


def random_block_tables(shape: BatchShape, num_blocks: int,
                        generator: torch.Generator) -> torch.Tensor:
    """Distinct random pool blocks per sequence; unused table entries are -1."""
    needed = [math.ceil(n / shape.block_size) for n in shape.seq_lens]
    total = sum(needed)
    if total > num_blocks:
        raise ValueError(f"the batch needs {total} blocks, the pool has {num_blocks}")
    span = min(num_blocks, max(4 * total, 64))
    picks = torch.randperm(span, generator=generator)[:total]
    ids = num_blocks - 1 - picks if shape.high_block_ids else picks
    tables = torch.full((len(needed), max(needed) + 1), -1, dtype=torch.int32)
    offset = 0
    for row, count in enumerate(needed):
        tables[row, :count] = ids[offset:offset + count]
        offset += count
    return tables


def random_paged_batch(shape: BatchShape, *, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu", seed: int = 0,
                       lazy_pool: bool = False) -> PagedBatch:
    """A batch whose used blocks hold random K/V; with `lazy_pool` the rest stays unwritten
    (never touched, so a pool far larger than memory costs only the pages it uses)."""
    if len(shape.seq_lens) != len(shape.query_lens):
        raise ValueError("seq_lens and query_lens must have one entry per sequence")
    generator = torch.Generator().manual_seed(seed)
    needed = sum(math.ceil(n / shape.block_size) for n in shape.seq_lens)
    num_blocks = shape.num_blocks or needed + 8
    tables = random_block_tables(shape, num_blocks, generator)
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    caches = []
    for _ in range(2):
        if lazy_pool:
            cache = torch.empty(cache_shape, dtype=dtype, device=device)
            # the reference gathers padding entries (-1, clamped to block 0) before masking
            # them: keep that block finite, whatever the allocator left there (a NaN there
            # survives a zero attention weight)
            cache[0] = 0
            used = tables[tables >= 0].long().to(device)
            cache[used] = torch.randn((len(used), *cache_shape[1:]), generator=generator
                                      ).to(device=device, dtype=dtype)
        else:
            cache = torch.randn(cache_shape, generator=generator).to(device=device, dtype=dtype)
        caches.append(cache)
    starts = [0]
    for q_len in shape.query_lens:
        starts.append(starts[-1] + q_len)
    query = torch.randn((starts[-1], shape.num_heads, shape.head_dim), generator=generator)
    return PagedBatch(
        query=query.to(device=device, dtype=dtype),
        key_cache=caches[0],
        value_cache=caches[1],
        block_tables=tables.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(shape.seq_lens, dtype=torch.int32, device=device),
        scale=1.0 / math.sqrt(shape.head_dim),
    )


def random_slots(num_tokens: int, num_blocks: int, block_size: int,
                 generator: torch.Generator, high: bool = False) -> torch.Tensor:
    """Distinct random int64 slots in the pool (from its top end when `high`)."""
    num_slots = num_blocks * block_size
    span = min(num_slots, max(8 * num_tokens, 256))
    picks = torch.randperm(span, generator=generator)[:num_tokens]
    return (num_slots - 1 - picks if high else picks).to(torch.int64)
