"""Sliding-window and soft-capped paged attention on every backend (the torch reference, the
CPU in-place op, Triton under the interpreter) against a dense masked softmax written here.
The Triton cases use tiny shapes: the interpreter pays for every program it runs."""

import math

import pytest
import torch

from sluice import kernels
from sluice.kernels import attention, cpu_paged, reference
from sluice.kernels.testing import BatchShape, decode_shape, mixed_shape, random_paged_batch

# decodes and chunks that start mid-sequence, over contexts of 1 to 100 tokens
MIXED = mixed_shape((6, 2))
# windows below every context, equal to some (16, 33, 40) and past all of them
WINDOWS = (1, 5, 16, 33, 40, 200)
SOFTCAP = 2.0  # small enough to bend most scores of these random batches
# Triton's tiny batch: decodes, a chunk resuming at 8, and a 33-token prefill that spans two
# query tiles of the kernel, with GQA
TINY = BatchShape((40, 9, 20, 1, 33), (1, 1, 12, 1, 33), 4, 2, head_dim=16)
FP32_ATOL = 2e-5
EVERYTHING_IN_PLACE = 1 << 30  # max_in_place_query that sends every chunk through the op


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
    return out


def assert_close_to_dense(got, batch, window, softcap, atol=FP32_ATOL):
    assert got.shape == batch.query.shape and got.dtype == batch.query.dtype
    want = dense_attention(batch, window, softcap).to(got.dtype)
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def mixed_batch():
    return random_paged_batch(MIXED, seed=21)


@pytest.fixture(scope="module")
def mixed_dense(mixed_batch):
    """dense_attention(mixed_batch, window, softcap), computed once per module and pair."""
    results = {}

    def dense(window, softcap):
        if (window, softcap) not in results:
            results[window, softcap] = dense_attention(mixed_batch, window, softcap).float()
        return results[window, softcap]

    return dense


@pytest.mark.parametrize("softcap", [0.0, SOFTCAP], ids=["no-cap", "cap"])
@pytest.mark.parametrize("window", (0, *WINDOWS))
def test_reference_matches_dense(mixed_batch, mixed_dense, window, softcap):
    got = reference.paged_attention(*mixed_batch.attention_args(), window=window,
                                    softcap=softcap)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, mixed_dense(window, softcap), atol=FP32_ATOL, rtol=0)


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


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_dispatch_passes_window_and_softcap(mixed_batch, mixed_dense, monkeypatch, backend):
    monkeypatch.setenv("SLUICE_ATTENTION", backend)
    got = kernels.paged_attention(*mixed_batch.attention_args(), window=16, softcap=SOFTCAP)
    torch.testing.assert_close(got, mixed_dense(16, SOFTCAP), atol=FP32_ATOL, rtol=0)


def cpu_in_place(batch, window=0, softcap=0.0, max_in_place_query=EVERYTHING_IN_PLACE):
    return cpu_paged.paged_attention(*batch.attention_args(), window=window, softcap=softcap,
                                     max_in_place_query=max_in_place_query)


def poison_before_windows(batch, window):
    """NaN into every K/V entry before the window of each sequence's first query token: a
    backend that reads one of them (even to mask it) returns NaN."""
    block_size = batch.key_cache.shape[1]
    starts = batch.query_start_loc.tolist()
    for seq, ctx_len in enumerate(batch.seq_lens.tolist()):
        first_pos = ctx_len - (starts[seq + 1] - starts[seq])
        for pos in range(max(0, first_pos - window + 1)):
            block = int(batch.block_tables[seq, pos // block_size])
            batch.key_cache[block, pos % block_size] = math.nan
            batch.value_cache[block, pos % block_size] = math.nan


@pytest.fixture(scope="module")
def cpu_op():
    cpu_paged._forget()  # a verdict recorded under another test's environment does not count
    if not cpu_paged.available():
        pytest.fail(f"the CPU op did not build: {cpu_paged.unavailable_reason()}")
    yield
    cpu_paged._forget()


@pytest.mark.parametrize("softcap", [0.0, SOFTCAP], ids=["no-cap", "cap"])
@pytest.mark.parametrize("window", (0, *WINDOWS))
@pytest.mark.parametrize("routing", ["all-in-place", "default"])
def test_cpu_op_matches_dense(cpu_op, mixed_batch, mixed_dense, window, softcap, routing):
    limit = EVERYTHING_IN_PLACE if routing == "all-in-place" else cpu_paged.MAX_IN_PLACE_QUERY
    got = cpu_in_place(mixed_batch, window, softcap, limit)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, mixed_dense(window, softcap), atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("shape", [mixed_shape((8, 1), 32), decode_shape((6, 2)),
                                   mixed_shape((2, 2), head_dim=128)], ids=lambda s: s.name)
def test_cpu_op_other_layouts_match_dense(cpu_op, shape):
    batch = random_paged_batch(shape, seed=23)
    for window, softcap in ((7, 0.0), (33, SOFTCAP), (0, 30.0)):
        assert_close_to_dense(cpu_in_place(batch, window, softcap), batch, window, softcap)


def test_cpu_op_bf16_accumulates_in_fp32(cpu_op):
    batch = random_paged_batch(MIXED, dtype=torch.bfloat16, seed=24)
    got = cpu_in_place(batch, window=9, softcap=SOFTCAP)
    assert got.dtype == torch.bfloat16
    exact = dense_attention(batch, 9, SOFTCAP)  # from the same rounded inputs, in fp64
    torch.testing.assert_close(got.double(), exact, atol=1e-2, rtol=0)


@pytest.mark.parametrize("window", [1, 5, 16, 20])
def test_cpu_op_never_reads_keys_before_the_window(cpu_op, window):
    # a windowed decode costs O(window): nothing before the window is read at all
    batch = random_paged_batch(MIXED, seed=25)
    want = dense_attention(batch, window, SOFTCAP).float()
    poison_before_windows(batch, window)
    got = cpu_in_place(batch, window, SOFTCAP)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)


def test_cpu_op_chunked_prefill_equals_one_pass_with_a_window(cpu_op):
    whole = random_paged_batch(BatchShape((50,), (50,), 6, 2), seed=26)
    want = dense_attention(whole, 12, SOFTCAP).float()
    pieces = []
    for start, end in ((0, 17), (17, 34), (34, 37), (37, 49), (49, 50)):
        pieces.append(cpu_paged.paged_attention(
            whole.query[start:end], whole.key_cache, whole.value_cache, whole.block_tables,
            torch.tensor([0, end - start], dtype=torch.int32),
            torch.tensor([end], dtype=torch.int32), whole.scale, window=12, softcap=SOFTCAP,
            max_in_place_query=EVERYTHING_IN_PLACE))
    torch.testing.assert_close(torch.cat(pieces), want, atol=FP32_ATOL, rtol=0)


def test_cpu_op_defaults_are_the_unwindowed_uncapped_result(cpu_op, mixed_batch):
    plain = cpu_in_place(mixed_batch)
    assert torch.equal(plain, cpu_in_place(mixed_batch, window=0, softcap=0.0))
    assert_close_to_dense(plain, mixed_batch, 0, 0.0)


@pytest.fixture(scope="module")
def tiny_batch():
    return random_paged_batch(TINY, seed=27)


def test_triton_runs_under_the_interpreter():
    assert type(attention._paged_attention_kernel).__name__ == "InterpretedFunction"


# windows below every context, equal to two (20, 33), past all; each with and without a cap
@pytest.mark.parametrize("window, softcap", [
    (0, SOFTCAP), (1, 0.0), (5, SOFTCAP), (20, 0.0), (33, SOFTCAP), (200, 0.0),
])
def test_triton_matches_dense(tiny_batch, window, softcap):
    got = attention.paged_attention(*tiny_batch.attention_args(), window=window,
                                    softcap=softcap)
    assert_close_to_dense(got, tiny_batch, window, softcap)


@pytest.mark.parametrize("shape, num_splits", [
    (BatchShape((40, 9, 70), (1, 1, 1), 4, 2, head_dim=16), 3),
    (TINY, 2),  # chunk rows whose window lies wholly in one split: the others weigh nothing
], ids=["decode", "mixed"])
def test_triton_split_keys_merge_with_a_window(shape, num_splits):
    batch = random_paged_batch(shape, seed=28)
    got = torch.full_like(batch.query, math.nan)
    attention.launch_paged_attention(got, *batch.attention_args(), num_splits=num_splits,
                                     window=7, softcap=SOFTCAP)
    assert_close_to_dense(got, batch, 7, SOFTCAP)


def test_triton_never_reads_key_tiles_before_the_window():
    batch = random_paged_batch(TINY, seed=29)
    want = dense_attention(batch, 6, SOFTCAP).float()
    poison_before_windows(batch, 6)
    got = attention.paged_attention(*batch.attention_args(), window=6, softcap=SOFTCAP)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=FP32_ATOL, rtol=0)


def test_triton_half_precision_accumulates_in_fp32():
    batch = random_paged_batch(TINY, dtype=torch.float16, seed=30)
    got = attention.paged_attention(*batch.attention_args(), window=9, softcap=SOFTCAP)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.double(), dense_attention(batch, 9, SOFTCAP), atol=2e-3,
                               rtol=0)


def test_triton_defaults_are_the_unwindowed_uncapped_result(tiny_batch):
    plain = attention.paged_attention(*tiny_batch.attention_args())
    assert torch.equal(plain, attention.paged_attention(*tiny_batch.attention_args(),
                                                        window=0, softcap=0.0))
    assert_close_to_dense(plain, tiny_batch, 0, 0.0)


def test_triton_refuses_a_bad_window_by_name(tiny_batch):
    with pytest.raises(ValueError, match="window"):
        attention.paged_attention(*tiny_batch.attention_args(), window=-3)
