"""The Triton paged attention (under the CPU interpreter) against the torch reference."""

import pytest
import torch

from sluice import kernels
from sluice.kernels import attention, reference
from sluice.kernels.testing import (
    BatchShape, decode_shape, mixed_shape, parity_grid, random_paged_batch,
)

FP32_ATOL = 1e-4


def assert_matches_reference(batch, atol=FP32_ATOL, rtol=0.0):
    got = attention.paged_attention(*batch.attention_args())
    want = reference.paged_attention(*batch.attention_args())
    assert got.shape == batch.query.shape and got.dtype == batch.query.dtype
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("shape", parity_grid(), ids=lambda s: s.name)
def test_matches_reference_fp32(shape):
    assert_matches_reference(random_paged_batch(shape, seed=len(shape.name)))


def test_kernel_runs_under_the_interpreter():
    # the whole file means nothing if a compiled (GPU-only) kernel were picked up instead
    assert type(attention._paged_attention_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("dtype, atol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_half_precision_accumulates_in_fp32(dtype, atol):
    batch = random_paged_batch(mixed_shape((6, 2)), dtype=dtype, seed=3)
    got = attention.paged_attention(*batch.attention_args())
    assert got.dtype == dtype
    exact = reference.paged_attention(
        batch.query.float(), batch.key_cache.float(), batch.value_cache.float(),
        batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.scale)
    torch.testing.assert_close(got.float(), exact, atol=atol, rtol=0.0)


def test_chunk_attends_to_cached_context_and_causally_within_itself():
    shape = BatchShape((40,), (24,), 2, 2)
    batch = random_paged_batch(shape, seed=5)
    got = attention.paged_attention(*batch.attention_args())
    # the same chunk's last token as a lone decode over the same context must agree
    last = BatchShape((40,), (1,), 2, 2)
    decode = random_paged_batch(last, seed=5)
    decode.key_cache, decode.value_cache = batch.key_cache, batch.value_cache
    decode.block_tables = batch.block_tables
    decode.query = batch.query[-1:].clone()
    alone = attention.paged_attention(*decode.attention_args())
    torch.testing.assert_close(got[-1:], alone, atol=FP32_ATOL, rtol=0.0)
    # and a chunk token may not see keys after it: changing the last key leaves it unchanged
    table = batch.block_tables[0]
    last_block, last_offset = int(table[39 // 16]), 39 % 16
    batch.key_cache[last_block, last_offset] += 10.0
    batch.value_cache[last_block, last_offset] += 10.0
    changed = attention.paged_attention(*batch.attention_args())
    torch.testing.assert_close(changed[:-1], got[:-1], atol=0.0, rtol=0.0)
    assert not torch.allclose(changed[-1], got[-1])


def test_reads_query_rows_with_a_token_stride():
    # the model hands over q as a view into the fused qkv projection
    batch = random_paged_batch(mixed_shape((6, 2)), seed=7)
    num_tokens, heads, dim = batch.query.shape
    fused = torch.randn(num_tokens, heads * dim + 2 * 2 * dim)
    fused[:, :heads * dim] = batch.query.reshape(num_tokens, -1)
    view = fused[:, :heads * dim].view(num_tokens, heads, dim)
    assert not view.is_contiguous()
    got = attention.paged_attention(view, *batch.attention_args()[1:])
    torch.testing.assert_close(got, reference.paged_attention(*batch.attention_args()),
                               atol=FP32_ATOL, rtol=0.0)


def test_pool_beyond_int32_element_offsets():
    # 33,000 blocks of 32 x 16 heads x 128 = 2.16e9 elements per cache: offsets of the top
    # blocks overflow int32. The pool is allocated but only the used blocks are ever touched.
    shape = BatchShape((40, 1), (1, 1), 16, 16, head_dim=128, block_size=32,
                       num_blocks=33_000, high_block_ids=True)
    try:
        batch = random_paged_batch(shape, seed=11, lazy_pool=True)
    except RuntimeError as error:  # an OS that refuses to reserve 17 GB of address space
        pytest.skip(f"cannot reserve the pool's address space: {error}")
    top_block_offset = batch.key_cache.stride(0) * int(batch.block_tables.max())
    assert top_block_offset > 2**31
    assert_matches_reference(batch)


def test_empty_batch_gives_empty_output():
    batch = random_paged_batch(decode_shape((2, 2)), seed=1)
    empty = attention.paged_attention(
        batch.query[:0], batch.key_cache, batch.value_cache, batch.block_tables[:0],
        batch.query_start_loc[:1], batch.seq_lens[:0], batch.scale)
    assert empty.shape == (0, 2, 64)


def test_dispatch_override_routes_cpu_tensors_to_triton(monkeypatch):
    batch = random_paged_batch(mixed_shape((8, 1)), seed=13)
    calls = []
    launch = attention.paged_attention
    monkeypatch.setattr(attention, "paged_attention",
                        lambda *args, **kwargs: calls.append(1) or launch(*args, **kwargs))
    monkeypatch.setenv("SLUICE_ATTENTION", "triton")
    got = kernels.paged_attention(*batch.attention_args())
    assert calls == [1]
    monkeypatch.setenv("SLUICE_ATTENTION", "torch")
    want = kernels.paged_attention(*batch.attention_args())
    assert calls == [1]
    torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0.0)


@pytest.mark.parametrize("shape, num_splits", [
    (decode_shape((6, 2)), 3),
    (decode_shape((8, 1), block_size=32), 4),
    (decode_shape((2, 2), head_dim=128), 2),
    # prefill rows see no key at all in later splits: the merge must weigh those as nothing
    (mixed_shape((6, 2)), 2),
], ids=lambda value: value.name if hasattr(value, "name") else str(value))
def test_split_keys_merge_to_the_reference(shape, num_splits):
    batch = random_paged_batch(shape, seed=17)
    got = torch.full_like(batch.query, float("nan"))
    attention.launch_paged_attention(got, *batch.attention_args(), num_splits=num_splits)
    torch.testing.assert_close(got, reference.paged_attention(*batch.attention_args()),
                               atol=FP32_ATOL, rtol=0.0)


def test_cpu_launches_do_not_split():
    assert attention.choose_num_splits(torch.device("cpu"), programs=1) == 1


def test_int64_step_metadata_gives_the_same_output():
    batch = random_paged_batch(mixed_shape((6, 2)), seed=19)
    want = attention.paged_attention(*batch.attention_args())
    batch.block_tables = batch.block_tables.long()
    batch.query_start_loc = batch.query_start_loc.long()
    batch.seq_lens = batch.seq_lens.long()
    torch.testing.assert_close(attention.paged_attention(*batch.attention_args()), want,
                               atol=0.0, rtol=0.0)
