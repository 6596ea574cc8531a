"""The decoder's fused elementwise ops on CPU against the torch expressions that define them,
in bf16 and fp16: rotary and SwiGLU give torch's bits, the residual add too, and the norm is
within a unit in the last place (it sums a row's squares in another order). A model in bf16
runs them; float32 keeps torch's own ops."""

from __future__ import annotations

import pytest
import torch

from sluice.actors.executor.model import ModelConfig, _add_rms_norm, _rotate
from sluice.actors.executor.runner import ModelRunner
from sluice.kernels import cpu_paged, elementwise

DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_paged.available(), cpu_paged.unavailable_reason()


def ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, hidden", [(1, 576), (7, 64), (64, 100), (300, 576)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_torch(dtype, rows, hidden, with_residual):
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    residual = torch.randn(rows, hidden, generator=g).to(dtype) if with_residual else None
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    normed, summed = elementwise.add_rms_norm(x, residual, weight, 1e-5)
    want_normed, want_summed = _add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, want_summed)
    assert normed.dtype == dtype and normed.shape == x.shape
    # one unit in the last place of the larger, at most
    torch.testing.assert_close(normed.float(), want_normed.float(), atol=1e-6,
                               rtol=2 * ulp(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads, head_dim", [(12, 64), (3, 128), (5, 80), (4, 96), (2, 10)])
@pytest.mark.parametrize("rows", [1, 9, 257])
def test_rotary_gives_torchs_bits_from_a_view_of_the_projection(dtype, heads, head_dim, rows):
    g = torch.Generator().manual_seed(heads * head_dim + rows)
    qkv = torch.randn(rows, (heads + 3) * head_dim, generator=g).to(dtype)
    x = qkv[:, :heads * head_dim].view(-1, heads, head_dim)  # rows apart, heads side by side
    angles = torch.rand(rows, 1, head_dim, generator=g) * 6.0
    cos, sin = angles.cos(), angles.sin()
    assert torch.equal(elementwise.rotate(x, cos, sin), _rotate(x, cos, sin))


def test_a_bf16_model_runs_them_and_float32_keeps_torchs():
    config = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=16)
    bf16 = ModelRunner.from_config(config, dtype="bfloat16", device="cpu", num_blocks=4)
    fp32 = ModelRunner.from_config(config, dtype="float32", device="cpu", num_blocks=4)
    assert bf16.model._add_rms_norm is not _add_rms_norm and bf16.model._rotate is not _rotate
    assert fp32.model._add_rms_norm is _add_rms_norm and fp32.model._rotate is _rotate


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, intermediate", [(1, 1536), (9, 100), (300, 1536)])
def test_swiglu_gives_torchs_bits(dtype, rows, intermediate):
    g = torch.Generator().manual_seed(rows + intermediate)
    gate_up = (torch.randn(rows, 2 * intermediate, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(elementwise.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)
