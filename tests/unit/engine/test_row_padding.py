"""Host reduced-precision matmuls run at padded row counts: what a worker keeps per row count
is bounded, the padding costs at most 1/16 more rows, and it never shows in results.

oneDNN (torch's host bf16/fp16 matmuls) keeps compiled kernels for every row count it has
met, so unpadded a worker's memory grows for as long as new step sizes turn up."""

from __future__ import annotations

import pytest
import torch
from support.scheduler import prefill_plan

from sluice.actors.executor.model import ModelConfig
from sluice.actors.executor.runner import ModelRunner

TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)


def runner(dtype: str) -> ModelRunner:
    return ModelRunner.from_config(TINY, dtype=dtype, device="cpu", num_blocks=32,
                                   block_size=16, seed=3)


def test_row_counts_are_few_and_close_to_the_rows_asked():
    model = runner("bfloat16").model
    padded = [model.padded_rows(n) for n in range(1, 2049)]
    assert padded[:32] == list(range(1, 33))  # small steps run as they are
    for n, rows in enumerate(padded, start=1):
        assert n <= rows <= n + n // 16, n
    # 32 below 33, then 16 per doubling: 32 + 16 * 6 up to 2048
    assert len(set(padded)) == 32 + 16 * 6


def test_float32_and_devices_without_the_cache_are_not_padded():
    model = runner("float32").model
    assert [model.padded_rows(n) for n in (33, 100, 1000)] == [33, 100, 1000]


@pytest.mark.parametrize("lengths", [[45, 24], [3, 97, 7], [129]])
def test_padding_changes_neither_logits_nor_the_kv_written(lengths):
    padded, exact = runner("bfloat16"), runner("bfloat16")
    exact.model.pads_rows = False
    total = sum(lengths)
    assert padded.model.padded_rows(total) > total  # these steps are padded
    plan = prefill_plan(lengths, 512)
    assert torch.equal(padded.forward_logits(plan), exact.forward_logits(plan))
    for (k1, v1), (k2, v2) in zip(padded.kv_pool, exact.kv_pool):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
