"""bfloat16 matmul weights are packed once into oneDNN's blocked layout on a CPU with native
bf16, and that never shows in results: the same logits and the same KV as plain matmuls, at
decode's row counts and at padded prefill ones, with tied and untied lm_heads; the
deterministic mode runs its fixed tiles over packed weights too."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.scheduler import prefill_plan

from sluice.actors.executor.model import ModelConfig, packs_weights
from sluice.actors.executor.runner import ModelRunner

TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
NATIVE_BF16 = packs_weights(torch.device("cpu"), torch.bfloat16)


def runner(dtype: str = "bfloat16", **changes) -> ModelRunner:
    config = dataclasses.replace(TINY, **changes)
    return ModelRunner.from_config(config, dtype=dtype, device="cpu", num_blocks=48,
                                   block_size=16, seed=5)


def test_only_bfloat16_on_a_native_bf16_cpu_is_packed():
    assert runner("bfloat16").model.packed == NATIVE_BF16
    assert not runner("float32").model.packed
    assert not runner("float16").model.packed


@pytest.mark.skipif(not NATIVE_BF16, reason="this CPU has no native bf16: nothing is packed")
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("lengths", [[1], [5, 1, 1], [45, 24], [3, 97, 7], [129]])
def test_packed_weights_give_the_plain_matmuls_logits_and_kv(tied, lengths):
    packed, plain = runner(tie_word_embeddings=tied), runner(tie_word_embeddings=tied)
    plain.model.pack_weights(False)
    assert packed.model.packed and not plain.model.packed
    step = prefill_plan(lengths, 512)
    assert torch.equal(packed.forward_logits(step), plain.forward_logits(step))
    for (k1, v1), (k2, v2) in zip(packed.kv_pool, plain.kv_pool):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.skipif(not NATIVE_BF16, reason="this CPU has no native bf16: nothing is packed")
def test_unpacked_weights_are_the_plain_ones_and_the_deterministic_mode_keeps_them_packed():
    model = runner().model
    model.pack_weights(False)
    assert not model.packed and model.lm_head is model.embed  # tied: one tensor again
    model.use_deterministic(True)
    assert model.packed  # its fixed tiles run over packed weights too
    model.use_deterministic(False)
    assert model.packed
    again = runner()
    step = prefill_plan([9, 1], 512)
    assert torch.equal(
        ModelRunner(model=model, num_blocks=48, block_size=16).forward_logits(step),
        again.forward_logits(step))
