"""One command that checks the Triton kernels on a CUDA GPU and reports JSON.

    python benchmarks/gpu_check.py [--out FILE] [--sections parity,bandwidth,window,engine]

(a) parity: every kernel against its torch reference in fp32, fp16 and bf16 over the same
    grid the CPU tests run under the interpreter (plus a pool past int32 element offsets);
(b) bandwidth: decode attention at batch 1/16/64/256 x context 512/2048/8192 (Llama-3-8B
    heads, bf16) in bytes moved per second, against a measured device-to-device copy;
(c) window: sliding-window and soft-capped attention against the reference in fp32, fp16 and
    bf16 (windows below, at and past the contexts, Gemma 2's cap of 50 and a tight one), and
    a long windowed decode's time against the same decode without the window;
(d) engine: a Llama-3-8B-shaped model with random bf16 weights, decode tokens/s at batch
    1/16/64/256 and prefill tokens/s, through the model runner and the kernel dispatch;
(e) everything goes to stdout as one JSON object, and to --out FILE.
Without CUDA it prints one line and exits 0. Sized to finish well inside 8 minutes on an
H200. `--interpret-smoke` runs every section on CPU under the Triton interpreter with tiny
shapes, to prove the code paths before a GPU is at hand.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SMOKE_FLAG = "--interpret-smoke"
if SMOKE_FLAG in sys.argv:  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["SLUICE_ATTENTION"] = "triton"

import torch  # noqa: E402

# tolerances against an fp32 reference computed from the same (rounded) inputs
ATOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
DECODE_BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 2048, 8192)
LLAMA3_8B = dict(vocab_size=128_256, hidden_size=4096, intermediate_size=14_336,
                 num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                 rope_theta=500_000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                 tie_word_embeddings=False, qkv_bias=False)
TINY_MODEL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=10_000.0,
                  rms_norm_eps=1e-5, max_position_embeddings=512,
                  tie_word_embeddings=False, qkv_bias=False)


def timed_ms(fn, device: torch.device) -> float:
    """Median milliseconds of fn (L2 flushed between runs on CUDA; one plain run on CPU)."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e3


def parity_section(device: torch.device, smoke: bool) -> dict:
    from sluice.kernels import attention, cache, reference
    from sluice.kernels.testing import (
        BatchShape, decode_shape, mixed_shape, parity_grid, random_paged_batch, random_slots,
    )

    grid = [decode_shape((6, 2)), mixed_shape((8, 1), 32)] if smoke else parity_grid()
    if not smoke:  # a pool whose top blocks sit past 2**31 elements
        grid.append(BatchShape((40, 1, 300), (1, 1, 60), 16, 16, head_dim=128, block_size=32,
                               num_blocks=33_000, high_block_ids=True))
    dtypes = (torch.float32, torch.float16) if smoke else tuple(ATOL)
    cases = []
    for dtype in dtypes:
        for index, shape in enumerate(grid):
            batch = random_paged_batch(shape, dtype=dtype, device=device, seed=index,
                                       lazy_pool=shape.num_blocks is not None)
            got = attention.paged_attention(*batch.attention_args()).float()
            want = reference.paged_attention(
                batch.query.float(), batch.key_cache.float(), batch.value_cache.float(),
                batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.scale)
            error = float((got - want).abs().max())
            cases.append(dict(kernel="paged_attention", case=shape.name,
                              dtype=DTYPE_NAMES[dtype], max_abs_error=error,
                              passed=bool(error <= ATOL[dtype] and torch.isfinite(got).all())))
        for block_size in (16, 32):
            generator = torch.Generator().manual_seed(block_size)
            pool = torch.randn(64, block_size, 8, 128, generator=generator).to(device, dtype)
            key = torch.randn(200, 8, 128, generator=generator).to(device, dtype)
            value = torch.randn(200, 8, 128, generator=generator).to(device, dtype)
            slots = random_slots(200, 64, block_size, generator).to(device)
            got_k, got_v, want_k, want_v = (pool.clone() for _ in range(4))
            cache.reshape_and_cache(key, value, got_k, got_v, slots)
            reference.reshape_and_cache(key, value, want_k, want_v, slots)
            exact = torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
            cases.append(dict(kernel="reshape_and_cache", case=f"bs{block_size}-kv8-d128",
                              dtype=DTYPE_NAMES[dtype], max_abs_error=0.0 if exact else None,
                              passed=exact))
    return dict(cases=cases, failed=sum(not c["passed"] for c in cases),
                total=len(cases), tolerances={DTYPE_NAMES[d]: a for d, a in ATOL.items()})


# (window, softcap) pairs the window section checks on every shape of its grid
WINDOW_CASES = ((1, 0.0), (17, 0.0), (64, 0.0), (0, 50.0), (0, 2.0), (33, 30.0), (4096, 50.0))


def window_section(device: torch.device, smoke: bool) -> dict:
    from sluice.kernels import attention, checks, reference
    from sluice.kernels.testing import (
        BatchShape, PagedBatch, decode_shape, mixed_shape, prefill_shape, random_paged_batch,
    )

    if smoke:
        grid = [mixed_shape((8, 1), 32)]
        settings = ((17, 0.0), (33, 30.0))
        dtypes = (torch.float32, torch.float16)
    else:
        grid = [decode_shape((6, 2)), prefill_shape((8, 1), 32), mixed_shape((6, 2)),
                mixed_shape((8, 1), 32), mixed_shape((6, 2), 16, head_dim=128),
                # long contexts: many key tiles wholly before the window, chunks of many tiles
                BatchShape((3000, 700, 5000, 1), (1, 300, 1, 1), 32, 8, head_dim=128)]
        settings = WINDOW_CASES
        dtypes = tuple(ATOL)
    cases = []
    for dtype in dtypes:
        for index, shape in enumerate(grid):
            batch = random_paged_batch(shape, dtype=dtype, device=device, seed=100 + index)
            for window, softcap in settings:
                got = attention.paged_attention(*batch.attention_args(), window=window,
                                                softcap=softcap).float()
                want = reference.paged_attention(
                    batch.query.float(), batch.key_cache.float(), batch.value_cache.float(),
                    batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.scale,
                    window=window, softcap=softcap)
                error = float((got - want).abs().max())
                cases.append(dict(case=shape.name, window=window, softcap=softcap,
                                  dtype=DTYPE_NAMES[dtype], max_abs_error=error,
                                  passed=bool(error <= ATOL[dtype]
                                              and torch.isfinite(got).all())))

    # a windowed decode reads only its window's key tiles: time it against the full context
    batch_size, context, window = (2, 64, 16) if smoke else (64, 8192, 1024)
    heads, kv_heads, head_dim, block_size = (4, 2, 64, 16) if smoke else (32, 8, 128, 16)
    dtype = torch.float32 if smoke else torch.bfloat16
    blocks = -(-context // block_size)
    pool_shape = (batch_size * blocks, block_size, kv_heads, head_dim)
    step = PagedBatch(
        query=torch.randn(batch_size, heads, head_dim, dtype=dtype, device=device),
        key_cache=torch.empty(pool_shape, dtype=dtype, device=device).normal_(),
        value_cache=torch.empty(pool_shape, dtype=dtype, device=device).normal_(),
        block_tables=torch.arange(batch_size * blocks, dtype=torch.int32,
                                  device=device).view(batch_size, blocks),
        query_start_loc=torch.arange(batch_size + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch_size,), context, dtype=torch.int32, device=device),
        scale=head_dim ** -0.5)
    checks.check_attention_arguments(*step.attention_args())
    out = torch.empty_like(step.query)
    timing = dict(batch=batch_size, context=context, window=window, dtype=DTYPE_NAMES[dtype])
    for name, kwargs in (("full_ms", {}), ("window_ms", dict(window=window)),
                         ("window_softcap_ms", dict(window=window, softcap=50.0))):
        timing[name] = timed_ms(
            lambda: attention.launch_paged_attention(out, *step.attention_args(), **kwargs),
            device)
    return dict(cases=cases, failed=sum(not c["passed"] for c in cases), total=len(cases),
                tolerances={DTYPE_NAMES[d]: a for d, a in ATOL.items()}, decode_time=timing)


def copy_bandwidth(device: torch.device, smoke: bool) -> float:
    """Bytes per second of a device-to-device copy (read plus write)."""
    elements = (1 << 16) if smoke else (1 << 30)  # 2 GiB of bf16 each way
    source = torch.empty(elements, dtype=torch.bfloat16, device=device).normal_()
    target = torch.empty_like(source)
    ms = timed_ms(lambda: target.copy_(source), device)
    return 2 * source.numel() * source.element_size() / (ms * 1e-3)


def bandwidth_section(device: torch.device, smoke: bool) -> dict:
    from sluice.kernels import attention, checks
    from sluice.kernels.testing import PagedBatch

    heads, kv_heads, head_dim, block_size = (4, 2, 64, 16) if smoke else (32, 8, 128, 16)
    batches, contexts = ((1, 2), (32,)) if smoke else (DECODE_BATCHES, CONTEXTS)
    dtype = torch.float32 if smoke else torch.bfloat16
    copy = copy_bandwidth(device, smoke)
    results = []
    for context in contexts:
        blocks_per_seq = -(-context // block_size)
        num_blocks = max(batches) * blocks_per_seq
        pool_shape = (num_blocks, block_size, kv_heads, head_dim)
        key_cache = torch.empty(pool_shape, dtype=dtype, device=device).normal_()
        value_cache = torch.empty(pool_shape, dtype=dtype, device=device).normal_()
        order = torch.randperm(num_blocks, device=device).to(torch.int32)
        for batch in batches:
            tables = order[:batch * blocks_per_seq].view(batch, blocks_per_seq).contiguous()
            step = PagedBatch(
                query=torch.randn(batch, heads, head_dim, dtype=dtype, device=device),
                key_cache=key_cache, value_cache=value_cache, block_tables=tables,
                query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
                seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
                scale=head_dim ** -0.5)
            out = torch.empty_like(step.query)
            checks.check_attention_arguments(*step.attention_args())
            ms = timed_ms(lambda: attention.launch_paged_attention(out, *step.attention_args()),
                          device)
            element = key_cache.element_size()
            moved = (2 * batch * context * kv_heads * head_dim * element  # K and V read
                     + 2 * step.query.numel() * element)  # q read, out written
            achieved = moved / (ms * 1e-3)
            splits = attention.choose_num_splits(device, batch * kv_heads)
            results.append(dict(batch=batch, context=context, splits=splits, ms=ms,
                                bytes=moved, bytes_per_s=achieved,
                                fraction_of_copy=achieved / copy))
        del key_cache, value_cache
    target = next((r for r in results if r["batch"] == 64 and r["context"] == 2048), None)
    return dict(dtype=DTYPE_NAMES[dtype], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                block_size=block_size, copy_bytes_per_s=copy, results=results,
                target=None if target is None else dict(
                    batch=64, context=2048, fraction_of_copy=target["fraction_of_copy"],
                    goal=0.70, met=target["fraction_of_copy"] >= 0.70))


def engine_section(device: torch.device, smoke: bool) -> dict:
    from sluice import kernels
    from sluice.actors.executor.model import ModelConfig
    from sluice.actors.executor.runner import ModelRunner
    from sluice.actors.scheduler.plan import ScheduledSeq, StepPlan
    from sluice.ipc.vocabulary import SamplingParams

    config = ModelConfig(**(TINY_MODEL if smoke else LLAMA3_8B))
    batches = (1, 2) if smoke else DECODE_BATCHES
    context = 24 if smoke else 512
    prefill_seqs, prefill_len = (2, 20) if smoke else (4, 2048)
    block_size = 16
    decode_blocks = -(-context // block_size)
    prefill_blocks = -(-prefill_len // block_size)
    num_blocks = max(max(batches) * decode_blocks, prefill_seqs * prefill_blocks)
    started = time.perf_counter()
    runner = ModelRunner.from_config(config, dtype="float32" if smoke else "bfloat16",
                                     device=str(device), num_blocks=num_blocks,
                                     block_size=block_size)
    build_s = time.perf_counter() - started
    greedy = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    iterations = 1 if smoke else 5

    def table(row: int, blocks: int) -> list[int]:
        return list(range(row * blocks, (row + 1) * blocks))

    def step_seconds(plan: StepPlan, repeats: int) -> float:
        runner.execute(plan)  # warm-up: compiles kernels, fills allocator caches
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            runner.execute(plan)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    decode = []
    for batch in batches:
        seqs = [ScheduledSeq(f"d{row}", [row % config.vocab_size], context - 1,
                             table(row, decode_blocks),
                             True, greedy, num_generated=1) for row in range(batch)]
        seconds = step_seconds(StepPlan(step_id=batch, seqs=seqs), iterations)
        decode.append(dict(batch=batch, context=context, step_ms=seconds * 1e3,
                           tokens_per_s=batch / seconds))
    prompt = [t % config.vocab_size for t in range(1, prefill_len + 1)]
    seqs = [ScheduledSeq(f"p{row}", prompt, 0, table(row, prefill_blocks), True, greedy)
            for row in range(prefill_seqs)]
    seconds = step_seconds(StepPlan(step_id=0, seqs=seqs), max(1, iterations // 2))
    probe = torch.empty(1, device=device)
    return dict(model="tiny" if smoke else "llama-3-8b-shaped (random weights)",
                dtype="float32" if smoke else "bfloat16", attention=kernels.backend_for(probe),
                build_seconds=build_s, decode=decode,
                prefill=dict(sequences=prefill_seqs, prompt_tokens=prefill_len,
                             step_ms=seconds * 1e3,
                             tokens_per_s=prefill_seqs * prefill_len / seconds))


SECTIONS = {"parity": parity_section, "bandwidth": bandwidth_section, "window": window_section,
            "engine": engine_section}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON report to this file")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="comma-separated subset of " + ",".join(SECTIONS))
    parser.add_argument(SMOKE_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {unknown[0]!r}; choose from {', '.join(SECTIONS)}")

    smoke = args.interpret_smoke
    import structlog  # the model's own log lines go to stderr: stdout is the report

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    if not smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check")
        return 0
    device = torch.device("cpu" if smoke else "cuda")
    report: dict = dict(device="cpu (Triton interpreter smoke run)" if smoke
                        else torch.cuda.get_device_name(device),
                        torch=torch.__version__)
    import triton

    report["triton"] = triton.__version__
    for name in sections:
        started = time.perf_counter()
        try:
            report[name] = SECTIONS[name](device, smoke)
        except Exception as error:  # one broken section must not hide the others' numbers
            report[name] = dict(error=f"{type(error).__name__}: {error}")
        report[name]["seconds"] = time.perf_counter() - started
        if device.type == "cuda":
            torch.cuda.empty_cache()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    failed = any("error" in report[n] or report[n].get("failed", 0) > 0 for n in sections)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
