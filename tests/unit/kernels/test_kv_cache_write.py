"""The Triton paged KV write (under the CPU interpreter) against the torch reference."""

import pytest
import torch

from sluice import kernels
from sluice.kernels import cache, reference
from sluice.kernels.testing import LARGE_POOL_BLOCKS, random_slots


def write_both(key, value, key_cache, value_cache, slots):
    """Run kernel and reference on copies of the pools; return both results."""
    got = (key_cache.clone(), value_cache.clone())
    want = (key_cache.clone(), value_cache.clone())
    cache.reshape_and_cache(key, value, *got, slots)
    reference.reshape_and_cache(key, value, *want, slots)
    return got, want


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_heads, head_dim", [(1, 64), (3, 64), (2, 128)])
def test_writes_the_same_slots_as_the_reference(block_size, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(block_size + kv_heads + head_dim)
    num_blocks, num_tokens = 12, 37
    pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    key = torch.randn(num_tokens, kv_heads, head_dim, generator=generator)
    value = torch.randn(num_tokens, kv_heads, head_dim, generator=generator)
    slots = random_slots(num_tokens, num_blocks, block_size, generator)
    got, want = write_both(key, value, pool, pool.clone(), slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    flat = got[0].view(-1, kv_heads, head_dim)
    assert torch.equal(flat[slots], key)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[untouched], pool.view(-1, kv_heads, head_dim)[untouched])


def test_large_pool_top_slots():
    generator = torch.Generator().manual_seed(2)
    shape = (LARGE_POOL_BLOCKS, 16, 2, 64)
    key_cache, value_cache = torch.zeros(shape), torch.zeros(shape)
    key, value = torch.randn(9, 2, 64, generator=generator), torch.randn(9, 2, 64)
    slots = random_slots(9, LARGE_POOL_BLOCKS, 16, generator, high=True)
    assert int(slots.min()) > (LARGE_POOL_BLOCKS - 64) * 16
    cache.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache.view(-1, 2, 64)[slots], key)
    assert torch.equal(value_cache.view(-1, 2, 64)[slots], value)


def test_pool_beyond_int32_element_offsets():
    # 33,000 blocks of 32 x 16 heads x 128: the top slots sit past 2**31 elements
    shape = (33_000, 32, 16, 128)
    try:
        key_cache, value_cache = torch.empty(shape), torch.empty(shape)
    except RuntimeError as error:  # an OS that refuses to reserve 17 GB of address space
        pytest.skip(f"cannot reserve the pool's address space: {error}")
    generator = torch.Generator().manual_seed(4)
    key, value = torch.randn(3, 16, 128, generator=generator), torch.randn(3, 16, 128)
    slots = random_slots(3, 33_000, 32, generator, high=True)
    assert int(slots.min()) * key_cache.stride(1) > 2**31
    cache.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache.view(-1, 16, 128)[slots], key)
    assert torch.equal(value_cache.view(-1, 16, 128)[slots], value)


def test_key_views_from_a_fused_projection_and_cast_to_the_cache_dtype():
    generator = torch.Generator().manual_seed(6)
    fused = torch.randn(20, 3 * 2 * 64, generator=generator)
    key = fused[:, 128:256].view(20, 2, 64)
    value = fused[:, 256:].view(20, 2, 64)
    assert not key.is_contiguous()
    pool = torch.zeros(4, 16, 2, 64, dtype=torch.float16)
    slots = random_slots(20, 4, 16, generator)
    got, want = write_both(key, value, pool, pool.clone(), slots)
    assert got[0].dtype == torch.float16
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_dispatch_override_routes_cpu_tensors_to_triton(monkeypatch):
    calls = []
    launch = cache.reshape_and_cache
    monkeypatch.setattr(cache, "reshape_and_cache",
                        lambda *args: calls.append(1) or launch(*args))
    monkeypatch.setenv("SLUICE_ATTENTION", "triton")
    key_cache, value_cache = torch.zeros(2, 16, 1, 64), torch.zeros(2, 16, 1, 64)
    key, value = torch.randn(3, 1, 64), torch.randn(3, 1, 64)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor([0, 17, 31]))
    assert calls == [1]
    assert torch.equal(key_cache.view(-1, 1, 64)[[0, 17, 31]], key)
