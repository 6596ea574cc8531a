"""The CPU backend that reads the paged pool in place, against the torch reference: parity,
no gather of the context in a decode, the fallback when it cannot be built, and the embedded
model's greedy output on it."""

import json
import os
import subprocess
import sys

import pytest
import structlog
import torch
from torch.profiler import ProfilerActivity, profile

from sluice import kernels
from sluice.ipc.vocabulary import SamplingParams
from sluice.kernels import cpu_paged, reference
from sluice.kernels.testing import (
    BatchShape, decode_shape, mixed_shape, parity_grid, random_paged_batch,
)

FP32_ATOL = 2e-5
BF16_ATOL = 1e-2  # the reference's own bf16 output rounding is ~7e-3 on these shapes
EVERYTHING_IN_PLACE = 1 << 30  # max_in_place_query that sends every chunk through the op
# ops that copy rows out of a tensor by index: what the reference gathers the context with
GATHERS = {"aten::index_select", "aten::index", "aten::gather", "aten::take",
           "aten::masked_select", "aten::clone"}
OP_NAME = "sluice_cpu::paged_attention_into"


@pytest.fixture(scope="session", autouse=True)
def in_place_backend():
    """Build (or load from the extension cache) once per session, off each test's clock."""
    cpu_paged._forget()  # a reason recorded under another test's environment does not count
    cpu_paged.available()
    yield
    cpu_paged._forget()


@pytest.fixture
def fresh_loader():
    """Let a test try the build again as a fresh process would, and forget its verdict after."""
    cpu_paged._forget()
    yield
    cpu_paged._forget()


def in_place(batch, max_in_place_query=EVERYTHING_IN_PLACE):
    return cpu_paged.paged_attention(*batch.attention_args(),
                                     max_in_place_query=max_in_place_query)


def test_the_in_place_backend_is_built_and_selected_on_cpu(monkeypatch):
    # every other test here means little if the build silently fell back to the reference
    monkeypatch.delenv("SLUICE_ATTENTION", raising=False)
    monkeypatch.delenv(cpu_paged.DISABLE_ENV, raising=False)
    assert cpu_paged.unavailable_reason() is None
    assert kernels.backend_for(torch.empty(1)) == "cpu"


@pytest.mark.parametrize("shape", parity_grid(), ids=lambda s: s.name)
@pytest.mark.parametrize("routing", ["all-in-place", "default"])
def test_matches_reference_fp32(shape, routing):
    batch = random_paged_batch(shape, seed=len(shape.name), lazy_pool=bool(shape.num_blocks))
    limit = EVERYTHING_IN_PLACE if routing == "all-in-place" else cpu_paged.MAX_IN_PLACE_QUERY
    got = in_place(batch, limit)
    assert got.shape == batch.query.shape and got.dtype == batch.query.dtype
    torch.testing.assert_close(got, reference.paged_attention(*batch.attention_args()),
                               atol=FP32_ATOL, rtol=0.0)


@pytest.mark.parametrize("shape", [decode_shape((6, 2)), mixed_shape((6, 2)),
                                   mixed_shape((8, 1), 32)], ids=lambda s: s.name)
def test_bf16_accumulates_in_fp32(shape):
    batch = random_paged_batch(shape, dtype=torch.bfloat16, seed=3)
    got = in_place(batch)
    assert got.dtype == torch.bfloat16
    exact = reference.paged_attention(
        batch.query.float(), batch.key_cache.float(), batch.value_cache.float(),
        batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.scale)
    torch.testing.assert_close(got.float(), exact, atol=BF16_ATOL, rtol=0.0)


@pytest.mark.parametrize("head_dim", [40, 80, 96, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (20, 0.0), (0, 2.0), (33, 5.0)])
def test_every_head_dim_and_option_matches_the_reference(head_dim, dtype, window, softcap):
    # head dims of whole 64-float groups, of single vectors past them, and of neither; decodes
    # and chunks in one call (their few rows go through 16-key tiles where the vectors allow)
    batch = random_paged_batch(mixed_shape((6, 2), 16, head_dim=head_dim), dtype=dtype,
                               seed=head_dim)
    got = cpu_paged.paged_attention(*batch.attention_args(), window=window, softcap=softcap,
                                    max_in_place_query=EVERYTHING_IN_PLACE)
    want = reference.paged_attention(
        batch.query.float(), batch.key_cache.float(), batch.value_cache.float(),
        batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.scale,
        window=window, softcap=softcap)
    torch.testing.assert_close(got.float(), want,
                               atol=FP32_ATOL if dtype == torch.float32 else BF16_ATOL, rtol=0.0)


def test_prefix_cache_hits_share_blocks_and_start_mid_pool():
    # three sequences over the same two cached blocks: a chunk resuming at 32, a decode and a
    # short chunk, each continuing into blocks of its own
    batch = random_paged_batch(BatchShape((52, 40, 35), (20, 1, 3), 6, 2), seed=9)
    shared = batch.block_tables[0, :2].clone()
    batch.block_tables[1:, :2] = shared
    want = reference.paged_attention(*batch.attention_args())
    for limit in (EVERYTHING_IN_PLACE, cpu_paged.MAX_IN_PLACE_QUERY):
        torch.testing.assert_close(in_place(batch, limit), want, atol=FP32_ATOL, rtol=0.0)


def test_chunked_prefill_equals_one_pass_over_the_prompt():
    whole = random_paged_batch(BatchShape((50,), (50,), 6, 2), seed=4)
    want = reference.paged_attention(*whole.attention_args())
    pieces = []
    for start, end in ((0, 17), (17, 34), (34, 37), (37, 50)):
        chunk = torch.tensor([0, end - start], dtype=torch.int32)
        pieces.append(cpu_paged.paged_attention(
            whole.query[start:end], whole.key_cache, whole.value_cache, whole.block_tables,
            chunk, torch.tensor([end], dtype=torch.int32), whole.scale,
            max_in_place_query=EVERYTHING_IN_PLACE))
    torch.testing.assert_close(torch.cat(pieces), want, atol=FP32_ATOL, rtol=0.0)


def test_a_chunk_token_never_sees_later_keys():
    batch = random_paged_batch(BatchShape((40,), (24,), 2, 2), seed=5)
    before = in_place(batch)
    table = batch.block_tables[0]
    batch.key_cache[int(table[39 // 16]), 39 % 16] += 10.0
    batch.value_cache[int(table[39 // 16]), 39 % 16] += 10.0
    after = in_place(batch)
    torch.testing.assert_close(after[:-1], before[:-1], atol=0.0, rtol=0.0)
    assert not torch.allclose(after[-1], before[-1])


def test_reads_query_rows_with_a_token_stride():
    # the model may hand over q as a view into the fused qkv projection
    batch = random_paged_batch(mixed_shape((6, 2)), seed=7)
    num_tokens, heads, dim = batch.query.shape
    fused = torch.randn(num_tokens, heads * dim + 2 * 2 * dim)
    fused[:, :heads * dim] = batch.query.reshape(num_tokens, -1)
    view = fused[:, :heads * dim].view(num_tokens, heads, dim)
    got = cpu_paged.paged_attention(view, *batch.attention_args()[1:])
    torch.testing.assert_close(got, reference.paged_attention(*batch.attention_args()),
                               atol=FP32_ATOL, rtol=0.0)


def test_a_query_in_another_dtype_than_the_pool_still_gets_the_reference_answer():
    batch = random_paged_batch(mixed_shape((6, 2)), dtype=torch.bfloat16, seed=6)
    batch.query = batch.query.float()
    got = cpu_paged.paged_attention(*batch.attention_args())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, reference.paged_attention(*batch.attention_args()),
                               atol=0.0, rtol=0.0)


def test_a_block_id_outside_the_pool_is_an_error_not_a_read():
    batch = random_paged_batch(decode_shape((2, 2)), seed=1)
    batch.block_tables[0, 0] = batch.key_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the pool"):
        in_place(batch)


def ops_seen(attention, batch) -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        attention(*batch.attention_args())
    return [event.name for event in prof.events()]


def test_a_decode_batch_copies_no_context_out_of_the_pool(monkeypatch):
    monkeypatch.delenv("SLUICE_ATTENTION", raising=False)
    batch = random_paged_batch(decode_shape((6, 2)), seed=11)
    seen = ops_seen(kernels.paged_attention, batch)  # through the dispatch the model uses
    assert OP_NAME in seen
    assert not GATHERS & set(seen), sorted(GATHERS & set(seen))
    # the check can see a gather: the reference's decode path is one
    assert "aten::index_select" in ops_seen(reference.paged_attention, batch)


def decode_step_ops(engine) -> list[str]:
    engine.add_request(prompt_token_ids=list(range(100, 140)),
                       sampling=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt's prefill
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()  # a decode step over a 40-token context
    while engine.has_unfinished():
        engine.step()
    return [event.name for event in prof.events()]


def test_a_model_decode_step_gathers_no_context(make_engine, monkeypatch):
    monkeypatch.delenv("SLUICE_ATTENTION", raising=False)
    engine = make_engine()
    seen = decode_step_ops(engine)
    assert seen.count(OP_NAME) == engine.runner.config.num_layers
    assert "aten::index_select" not in seen
    monkeypatch.setenv("SLUICE_ATTENTION", "torch")
    assert "aten::index_select" in decode_step_ops(make_engine())


PROMPTS = ["The capital of France is", "List three rivers of Europe and their lengths:",
           "def fibonacci(n):"]


def greedy(engine) -> list[list[int]]:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    return [done.token_ids for done in engine.generate(PROMPTS, params)]


def test_embedded_model_greedy_output_equals_the_reference(make_engine, monkeypatch):
    # prefill in chunks of 3 so that chunks with cached context run in place too
    monkeypatch.setenv("SLUICE_ATTENTION", "torch")
    want = greedy(make_engine(max_prefill_chunk=3))
    monkeypatch.delenv("SLUICE_ATTENTION")
    assert kernels.backend_for(torch.empty(1)) == "cpu"
    got = greedy(make_engine(max_prefill_chunk=3))
    assert [len(tokens) for tokens in got] == [16] * len(PROMPTS)
    assert got == want


def test_turned_off_it_falls_back_to_the_reference_and_says_so_once(
        make_engine, monkeypatch, fresh_loader):
    monkeypatch.setenv("SLUICE_ATTENTION", "torch")
    want = greedy(make_engine())
    monkeypatch.delenv("SLUICE_ATTENTION")
    monkeypatch.setenv(cpu_paged.DISABLE_ENV, "off")
    # the reference engine loaded the library for its other ops (the fused elementwise steps,
    # the greedy argmax): a fresh start with the setting is what is tested
    cpu_paged._forget()
    with structlog.testing.capture_logs() as logs:
        assert kernels.backend_for(torch.empty(1)) == "torch"
        got = greedy(make_engine())
    assert got == want
    warnings = [entry for entry in logs if entry["log_level"] == "warning"]
    assert len(warnings) == 1
    assert cpu_paged.DISABLE_ENV in warnings[0]["reason"]
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu_paged.paged_attention(*random_paged_batch(decode_shape((2, 2))).attention_args())


_FAILED_BUILD_SCRIPT = """
import json
import structlog
import torch
from sluice import kernels
from sluice.kernels import cpu_paged, reference
from sluice.kernels.testing import mixed_shape, random_paged_batch

with structlog.testing.capture_logs() as logs:
    batch = random_paged_batch(mixed_shape((6, 2)), seed=2)
    got = kernels.paged_attention(*batch.attention_args())
    kernels.paged_attention(*batch.attention_args())
want = reference.paged_attention(*batch.attention_args())
print(json.dumps({
    "reason": cpu_paged.unavailable_reason(),
    "backend": kernels.backend_for(batch.query),
    "warnings": [e["event"] for e in logs if e["log_level"] == "warning"],
    "equal": bool(torch.equal(got, want)),
}))
"""


def test_a_failed_build_falls_back_with_the_reason(tmp_path):
    # a real build attempt with a compiler that does not exist, in an empty extension cache,
    # in a fresh process: this one has the library loaded already, and loads it only once
    env = {k: v for k, v in os.environ.items()
           if k not in (cpu_paged.DISABLE_ENV, "SLUICE_ATTENTION")}
    env.update(CXX=str(tmp_path / "no-such-compiler"),
               TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    done = subprocess.run([sys.executable, "-c", _FAILED_BUILD_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["reason"].startswith("build failed")
    assert outcome["backend"] == "torch"
    assert outcome["warnings"] == ["cpu paged attention unavailable, using the torch reference"]
    assert outcome["equal"]


def test_a_build_lock_left_by_a_killed_builder_is_removed(tmp_path):
    # torch would wait on it forever; a lock younger than any build could be is left alone
    stale, live = tmp_path / "stale", tmp_path / "live"
    stale.touch()
    live.touch()
    old = stale.stat().st_mtime - cpu_paged.STALE_LOCK_SECONDS - 60
    os.utime(stale, (old, old))
    cpu_paged._clear_stale_lock(stale)
    cpu_paged._clear_stale_lock(live)
    cpu_paged._clear_stale_lock(tmp_path / "absent")
    assert not stale.exists() and live.exists()
