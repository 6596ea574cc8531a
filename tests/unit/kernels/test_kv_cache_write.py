"""The paged KV writes against the torch reference: Triton's (under the CPU interpreter) and
the CPU op's (one copy per token, for key, value and pool of one dtype)."""

import pytest
import torch

from sluice import kernels
from sluice.kernels import cache, cpu_paged, reference
from sluice.kernels.testing import LARGE_POOL_BLOCKS, random_slots

WRITERS = {"triton": cache.reshape_and_cache, "cpu": cpu_paged.reshape_and_cache}


@pytest.fixture(params=sorted(WRITERS))
def writer(request):
    if request.param == "cpu":
        assert cpu_paged.available(), cpu_paged.unavailable_reason()
    return WRITERS[request.param]


def write_both(key, value, key_cache, value_cache, slots, write=cache.reshape_and_cache):
    """Run kernel and reference on copies of the pools; return both results."""
    got = (key_cache.clone(), value_cache.clone())
    want = (key_cache.clone(), value_cache.clone())
    write(key, value, *got, slots)
    reference.reshape_and_cache(key, value, *want, slots)
    return got, want


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_heads, head_dim", [(1, 64), (3, 64), (2, 128)])
def test_writes_the_same_slots_as_the_reference(writer, block_size, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(block_size + kv_heads + head_dim)
    num_blocks, num_tokens = 12, 37
    pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    key = torch.randn(num_tokens, kv_heads, head_dim, generator=generator)
    value = torch.randn(num_tokens, kv_heads, head_dim, generator=generator)
    slots = random_slots(num_tokens, num_blocks, block_size, generator)
    got, want = write_both(key, value, pool, pool.clone(), slots, writer)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    flat = got[0].view(-1, kv_heads, head_dim)
    assert torch.equal(flat[slots], key)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[untouched], pool.view(-1, kv_heads, head_dim)[untouched])


def test_large_pool_top_slots(writer):
    generator = torch.Generator().manual_seed(2)
    shape = (LARGE_POOL_BLOCKS, 16, 2, 64)
    key_cache, value_cache = torch.zeros(shape), torch.zeros(shape)
    key, value = torch.randn(9, 2, 64, generator=generator), torch.randn(9, 2, 64)
    slots = random_slots(9, LARGE_POOL_BLOCKS, 16, generator, high=True)
    assert int(slots.min()) > (LARGE_POOL_BLOCKS - 64) * 16
    writer(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache.view(-1, 2, 64)[slots], key)
    assert torch.equal(value_cache.view(-1, 2, 64)[slots], value)


def test_pool_beyond_int32_element_offsets(writer):
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
    writer(key, value, key_cache, value_cache, slots)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_cpu_op_writes_views_of_a_fused_projection(dtype):
    generator = torch.Generator().manual_seed(8)
    fused = torch.randn(20, 3 * 2 * 64, generator=generator).to(dtype)
    key = fused[:, 128:256].view(20, 2, 64)
    value = fused[:, 256:].view(20, 2, 64)
    pool = torch.randn(4, 16, 2, 64, generator=generator).to(dtype)
    slots = random_slots(20, 4, 16, generator)
    got, want = write_both(key, value, pool, pool.clone(), slots, cpu_paged.reshape_and_cache)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("bad", [64, -1, 1 << 40])
def test_a_slot_outside_the_pool_is_an_error_and_nothing_is_written(bad):
    generator = torch.Generator().manual_seed(9)
    key, value = torch.randn(3, 2, 64, generator=generator), torch.randn(3, 2, 64)
    key_cache, value_cache = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
    slots = torch.tensor([5, bad, 7])
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_paged.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert not key_cache.any() and not value_cache.any()


def test_the_ops_run_on_every_thread_torch_is_given():
    # a build without OpenMP runs every work item on the calling thread, whatever torch says
    assert cpu_paged.available(), cpu_paged.unavailable_reason()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert cpu_paged.threads_used(64) == 2
        torch.set_num_threads(1)
        assert cpu_paged.threads_used(64) == 1
    finally:
        torch.set_num_threads(before)


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
