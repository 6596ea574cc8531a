"""Sliding-window and soft-capped paged attention on every backend (the torch reference, the
CPU in-place op, Triton under the interpreter) against a dense masked softmax written here."""

import math

import pytest
import torch

from sluice import kernels
from sluice.kernels import reference
from sluice.kernels.testing import BatchShape, mixed_shape, random_paged_batch

# decodes and chunks that start mid-sequence, over contexts of 1 to 100 tokens
MIXED = mixed_shape((6, 2))
# windows below every context, equal to some (16, 33, 40) and past all of them
WINDOWS = (1, 5, 16, 33, 40, 200)
SOFTCAP = 2.0  # small enough to bend most scores of these random batches


def dense_attention(batch, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """In float64, one sequence at a time: every key of the context is scored, the scores
    capped, those outside p - window < k <= p masked out, then softmax and the value sum."""
    query = batch.query.double()
    out = torch.empty_like(query)
    block_size = batch.key_cache.shape[1]
    group = query.shape[1] // batch.key_cache.shape[2]
    starts = batch.query_start_loc.tolist()
    for seq, ctx_len in enumerate(batch.seq_lens.tolist()):
        positions = torch.arange(ctx_len)
        blocks = batch.block_tables[seq].long()[positions // block_size]
        keys = batch.key_cache[blocks, positions % block_size].double()  # [L, kvh, d]
        values = batch.value_cache[blocks, positions % block_size].double()
        keys = keys.repeat_interleave(group, dim=1)  # [L, H, d]
        values = values.repeat_interleave(group, dim=1)
        tokens = slice(starts[seq], starts[seq + 1])
        q_len = starts[seq + 1] - starts[seq]
        query_pos = torch.arange(ctx_len - q_len, ctx_len)[:, None]  # [q, 1]
        scores = torch.einsum("qhd,lhd->qhl", query[tokens], keys) * batch.scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        visible = positions[None, :] <= query_pos  # [q, L]
        if window:
            visible &= positions[None, :] > query_pos - window
        scores = scores.masked_fill(~visible[:, None, :], -math.inf)
        out[tokens] = torch.einsum("qhl,lhd->qhd", torch.softmax(scores, dim=-1), values)
    return out.to(batch.query.dtype)


def assert_close_to_dense(got, batch, window, softcap, atol=2e-5):
    assert got.shape == batch.query.shape and got.dtype == batch.query.dtype
    torch.testing.assert_close(got, dense_attention(batch, window, softcap), atol=atol, rtol=0)


@pytest.fixture(scope="module")
def mixed_batch():
    return random_paged_batch(MIXED, seed=21)


@pytest.mark.parametrize("softcap", [0.0, SOFTCAP], ids=["no-cap", "cap"])
@pytest.mark.parametrize("window", (0, *WINDOWS))
def test_reference_matches_dense(mixed_batch, window, softcap):
    got = reference.paged_attention(*mixed_batch.attention_args(), window=window,
                                    softcap=softcap)
    assert_close_to_dense(got, mixed_batch, window, softcap)


def test_defaults_leave_the_result_bit_identical(mixed_batch):
    plain = reference.paged_attention(*mixed_batch.attention_args())
    explicit = reference.paged_attention(*mixed_batch.attention_args(), window=0, softcap=0.0)
    assert torch.equal(plain, explicit)


def test_a_window_past_every_context_changes_nothing(mixed_batch):
    plain = reference.paged_attention(*mixed_batch.attention_args())
    wide = reference.paged_attention(*mixed_batch.attention_args(), window=10_000)
    torch.testing.assert_close(wide, plain, atol=1e-6, rtol=0)


def test_a_window_of_one_attends_to_the_token_itself():
    batch = random_paged_batch(BatchShape((20, 9), (4, 1), 2, 2), seed=2)
    got = reference.paged_attention(*batch.attention_args(), window=1)
    # each query's output is the value stored at its own position
    expected = []
    for seq, (ctx_len, q_len) in enumerate(((20, 4), (9, 1))):
        for pos in range(ctx_len - q_len, ctx_len):
            block = int(batch.block_tables[seq, pos // 16])
            expected.append(batch.value_cache[block, pos % 16])
    torch.testing.assert_close(got, torch.stack(expected), atol=1e-6, rtol=0)


@pytest.mark.parametrize("window, softcap, error", [
    (-1, 0.0, "window"), (2.5, 0.0, "window"), (True, 0.0, "window"),
    (0, -1.0, "softcap"), (0, math.inf, "softcap"), (0, math.nan, "softcap"),
    (0, "50", "softcap"),
])
def test_bad_window_or_softcap_is_refused_by_name(mixed_batch, window, softcap, error):
    with pytest.raises(ValueError, match=error):
        kernels.paged_attention(*mixed_batch.attention_args(), window=window, softcap=softcap)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_dispatch_passes_window_and_softcap(mixed_batch, monkeypatch, backend):
    monkeypatch.setenv("SLUICE_ATTENTION", backend)
    got = kernels.paged_attention(*mixed_batch.attention_args(), window=16, softcap=SOFTCAP)
    assert_close_to_dense(got, mixed_batch, 16, SOFTCAP)
