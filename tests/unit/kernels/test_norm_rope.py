"""The fused RMSNorm and rotary kernels (under the CPU interpreter) against their references."""

import pytest
import torch

from sluice.kernels import norm_rope, norm_rope_reference

# half precision: rounding twice (after the norm, after the weight) may land one or two ulps
# apart from torch's, so the tolerance is relative as well as absolute
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def rotary_tables(head_dim: int, positions: int, theta: float = 10_000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(positions).float(), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("hidden", [576, 128])
def test_rms_norm_matches_reference(dtype, hidden):
    generator = torch.Generator().manual_seed(hidden)
    x = (torch.randn(7, hidden, generator=generator) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(dtype)
    got = norm_rope.rms_norm(x, weight, 1e-5)
    want = norm_rope_reference.rms_norm(x, weight, 1e-5)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_add_rms_norm_returns_the_residual_stream_and_its_norm(dtype):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 320, generator=generator).to(dtype)
    residual = torch.randn(5, 320, generator=generator).to(dtype)
    weight = torch.rand(320, generator=generator).to(dtype)
    normed, summed = norm_rope.add_rms_norm(x, residual, weight, 1e-6)
    want_normed, want_summed = norm_rope_reference.add_rms_norm(x, residual, weight, 1e-6)
    if dtype == torch.bfloat16:  # the interpreter rounds fp32 -> bf16 toward zero: one ulp
        torch.testing.assert_close(summed, want_summed, atol=0.0, rtol=2**-7)
    else:
        assert torch.equal(summed, want_summed)
    torch.testing.assert_close(normed.float(), want_normed.float(), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 128)])
def test_rotary_matches_reference_on_views_of_a_fused_projection(dtype, heads, kv_heads,
                                                                 head_dim):
    generator = torch.Generator().manual_seed(heads)
    tokens = 11
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    query = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    key = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads,
                                                                      head_dim)
    cos, sin = (t.to(dtype) for t in rotary_tables(head_dim, 4096))
    positions = torch.randint(0, 4096, (tokens,), generator=generator)
    got_q, got_k = norm_rope.rotary_embedding(query, key, positions, cos, sin)
    want_q, want_k = norm_rope_reference.rotary_embedding(query, key, positions, cos, sin)
    for got, want in ((got_q, want_q), (got_k, want_k)):
        assert got.is_contiguous() and got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCE[dtype],
                                   rtol=TOLERANCE[dtype])


def test_rotary_at_position_zero_is_the_identity():
    cos, sin = rotary_tables(64, 16)
    query, key = torch.randn(3, 2, 64), torch.randn(3, 1, 64)
    got_q, got_k = norm_rope.rotary_embedding(query, key, torch.zeros(3, dtype=torch.long),
                                              cos, sin)
    assert torch.equal(got_q, query) and torch.equal(got_k, key)


@pytest.mark.parametrize("call, error, message", [
    (lambda: norm_rope.rms_norm(torch.randn(2, 8), torch.ones(9), 1e-5), ValueError,
     "weight has 9 entries"),
    (lambda: norm_rope.rms_norm(torch.randn(2, 8).double(), torch.ones(8), 1e-5), TypeError,
     "x must have dtype"),
    (lambda: norm_rope.rms_norm(torch.randn(8, 2).t(), torch.ones(8), 1e-5), ValueError,
     "x must have stride 1"),
    (lambda: norm_rope.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 0.0),
     ValueError, "residual has shape"),
    (lambda: norm_rope.rotary_embedding(torch.randn(2, 2, 64), torch.randn(2, 1, 64),
                                        torch.tensor([0, 16]), *rotary_tables(64, 16)),
     ValueError, "positions must lie in \\[0, 16\\)"),
    (lambda: norm_rope.rotary_embedding(torch.randn(2, 2, 64), torch.randn(2, 1, 64),
                                        torch.tensor([0.0, 1.0]), *rotary_tables(64, 16)),
     TypeError, "positions must have dtype"),
    (lambda: norm_rope.rotary_embedding(torch.randn(2, 2, 64), torch.randn(2, 1, 32),
                                        torch.tensor([0, 1]), *rotary_tables(64, 16)),
     ValueError, "key has shape"),
])
def test_launchers_reject_bad_arguments(call, error, message):
    with pytest.raises(error, match=message):
        call()
