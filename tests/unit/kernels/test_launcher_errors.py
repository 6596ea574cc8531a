"""The launchers refuse what the kernels would get wrong, with errors naming the argument."""

import re

import pytest
import torch

from sluice.kernels import attention, cache
from sluice.kernels.testing import mixed_shape, random_paged_batch


@pytest.fixture
def batch():
    return random_paged_batch(mixed_shape((6, 2)), seed=21)


def attend(batch, **replace):
    args = dict(query=batch.query, key_cache=batch.key_cache, value_cache=batch.value_cache,
                block_tables=batch.block_tables, query_start_loc=batch.query_start_loc,
                seq_lens=batch.seq_lens, scale=batch.scale)
    args.update(replace)
    return attention.paged_attention(**args)


@pytest.mark.parametrize("argument, bad", [
    ("query", lambda b: b.query.double()),
    ("key_cache", lambda b: b.key_cache.half()),
    ("block_tables", lambda b: b.block_tables.float()),
    ("query_start_loc", lambda b: b.query_start_loc.float()),
    ("seq_lens", lambda b: b.seq_lens.to(torch.int16)),
])
def test_attention_rejects_wrong_dtypes(batch, argument, bad):
    with pytest.raises(TypeError, match=argument):
        attend(batch, **{argument: bad(batch)})


@pytest.mark.parametrize("argument, bad", [
    ("query", lambda b: b.query.transpose(1, 2).contiguous().transpose(1, 2)),
    ("key_cache", lambda b: b.key_cache.transpose(1, 2).contiguous().transpose(1, 2)),
    ("value_cache", lambda b: torch.cat([b.value_cache, b.value_cache], dim=2)[:, :, ::2]),
    ("block_tables", lambda b: torch.cat([b.block_tables, b.block_tables], dim=1)[:, ::2]),
])
def test_attention_rejects_non_contiguous_inputs(batch, argument, bad):
    value = bad(batch)
    assert not value.is_contiguous()
    with pytest.raises(ValueError, match=argument):
        attend(batch, **{argument: value})


def test_attention_rejects_query_heads_not_a_multiple_of_kv_heads(batch):
    five_heads = batch.query[:, :5].contiguous()
    with pytest.raises(ValueError, match="5 heads, not a multiple of key_cache's 2 KV heads"):
        attend(batch, query=five_heads)


def test_attention_rejects_mismatched_head_dims_and_pools(batch):
    with pytest.raises(ValueError, match="head_dim 32"):
        attend(batch, query=batch.query[..., :32].contiguous())
    with pytest.raises(ValueError, match="value_cache has shape"):
        attend(batch, value_cache=batch.value_cache[:-1].contiguous())


@pytest.mark.parametrize("bad_id", [-1, "num_blocks", 10**6])
def test_attention_rejects_out_of_range_block_ids(batch, bad_id):
    num_blocks = batch.key_cache.shape[0]
    tables = batch.block_tables.clone()
    value = num_blocks if bad_id == "num_blocks" else bad_id
    tables[2, 1] = value  # sequence 2 has 33 tokens, so its second block is in use
    message = re.escape(f"block_tables[2, 1] = {value} is outside the pool of {num_blocks}")
    with pytest.raises(ValueError, match=message):
        attend(batch, block_tables=tables)


def test_attention_ignores_unused_table_entries(batch):
    tables = batch.block_tables.clone()
    tables[5, 1:] = 10**6  # sequence 5 has one token: only its first block is in use
    out = attend(batch, block_tables=tables)
    assert torch.isfinite(out).all()


def test_attention_sees_in_place_edits_after_a_passing_call(batch):
    # the value checks are remembered per tensor; editing one in place must undo that
    attend(batch)
    batch.block_tables[0, 0] = 10**6
    with pytest.raises(ValueError, match="block_tables"):
        attend(batch)


@pytest.mark.parametrize("argument, edit, message", [
    ("seq_lens", lambda t: t.__setitem__(0, 20), "sequence 0 has 30 query tokens but seq_lens"),
    ("seq_lens", lambda t: t.__setitem__(6, 400), "seq_lens\\[6\\] = 400 exceeds"),
    ("query_start_loc", lambda t: t.__setitem__(-1, 3), "must end at the query's"),
    ("query_start_loc", lambda t: t.__setitem__(2, 0), "non-decreasing"),
])
def test_attention_rejects_inconsistent_step_metadata(batch, argument, edit, message):
    value = getattr(batch, argument).clone()
    edit(value)
    with pytest.raises(ValueError, match=message):
        attend(batch, **{argument: value})


def test_attention_rejects_mismatched_sequence_counts_and_bad_scale(batch):
    with pytest.raises(ValueError, match="query_start_loc has 7 entries"):
        attend(batch, query_start_loc=batch.query_start_loc[:-1].contiguous())
    with pytest.raises(ValueError, match="block_tables has 6 rows"):
        attend(batch, block_tables=batch.block_tables[:-1].contiguous())
    with pytest.raises(ValueError, match="scale"):
        attend(batch, scale=float("nan"))


def test_cpu_tensors_without_the_interpreter_are_refused(batch, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="need CUDA tensors"):
        attend(batch)


def write(**replace):
    args = dict(key=torch.randn(4, 2, 64), value=torch.randn(4, 2, 64),
                key_cache=torch.zeros(3, 16, 2, 64), value_cache=torch.zeros(3, 16, 2, 64),
                slot_mapping=torch.tensor([0, 5, 16, 47]))
    args.update(replace)
    cache.reshape_and_cache(**args)


@pytest.mark.parametrize("replace, error, message", [
    (dict(key=torch.randn(4, 2, 64, dtype=torch.float64)), TypeError, "key must have dtype"),
    (dict(value=torch.randn(4, 2, 64).half()), TypeError, "value has dtype float16"),
    (dict(key_cache=torch.zeros(3, 16, 2, 64, dtype=torch.int8)), TypeError, "key_cache"),
    (dict(slot_mapping=torch.tensor([0, 5, 16, 47], dtype=torch.int32)), TypeError,
     "slot_mapping must have dtype int64"),
    (dict(key=torch.randn(4, 64, 2).transpose(1, 2)), ValueError, "key must have stride 1"),
    (dict(value_cache=torch.zeros(3, 2, 16, 64).transpose(1, 2)), ValueError,
     "value_cache must be contiguous"),
    (dict(key=torch.randn(4, 3, 64), value=torch.randn(4, 3, 64)), ValueError,
     "key has 3 KV heads but key_cache has 2"),
    (dict(slot_mapping=torch.tensor([0, 5, 16])), ValueError, "3 entries for 4 tokens"),
    (dict(slot_mapping=torch.tensor([0, 5, 48, 1])), ValueError, "slot 48, outside the pool"),
    (dict(slot_mapping=torch.tensor([0, -1, 4, 1])), ValueError, "slot -1, outside the pool"),
])
def test_cache_write_rejects_bad_arguments(replace, error, message):
    with pytest.raises(error, match=message):
        write(**replace)
