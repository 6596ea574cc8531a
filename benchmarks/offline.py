"""Offline throughput: sluice against transformers and llama.cpp on one seeded workload.

Every system gets the same token ids, the same weights (the embedded SmolLM2 GGUF unless
`--model` says otherwise) and the same thread count; each is timed from its first submitted
request to its last finished one, after a small warm-up, model loading excluded. `sluice`
runs at the engine's default dtype, `sluice-fp32` in float32 (`sluice-det` and
`sluice-fp32-det`, run only when named, are the same in the deterministic mode, for its
cost), transformers in `--dtype`
(float32 unless told otherwise), llama.cpp on the GGUF's own quantized weights. Greedy by
default, or sampled with `--temperature`/`--top-p` (seeded per request); EOS ignored;
per-request output lengths. The same run measures this machine's peak matmul rate in every
dtype a system used and reports each sluice system's share of its dtype's roofline.

    python benchmarks/offline.py [--requests N] [--seed S] [--dtype float32|bfloat16]
                                 [--systems sluice,sluice-fp32,transformers-cb,...]
                                 [--temperature T --top-p P] [--threads N]
                                 [--llama-parallel N] [--model PATH] [--json] [--profile]
                                 [--tensor-parallel N] [--part K/N]

What the peers are, and what counts as useful output, is written next to each runner below.
`--profile` runs sluice under the torch profiler and prints where its step time goes
(GEMMs, attention, KV write, elementwise, sampling, input preparation, Python/other; see
`step_profile.py`); the profiler's own overhead slows that run, so its tok/s is not comparable.

Correctness is not this file's business (the test suite checks greedy parity); it only
reports how many requests produced the same tokens as sluice, as a sanity check.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

SYSTEMS = ("sluice", "sluice-fp32", "transformers-static-8", "transformers-static-32",
           "transformers-cb", "llama-cpp")
# the engine's deterministic mode: named in --systems only, never run by default
DETERMINISTIC_SYSTEMS = ("sluice-det", "sluice-fp32-det")
SLUICE_SYSTEMS = ("sluice", "sluice-fp32", *DETERMINISTIC_SYSTEMS)
PROMPT_MIN, PROMPT_MAX = 16, 512
OUTPUT_MIN, OUTPUT_MAX = 16, 128
# log-normal prompt lengths; with the default seed 64 requests come to about 11k prompt tokens
PROMPT_MU, PROMPT_SIGMA = 4.8, 0.75
CORPUS_CHARS = 600_000  # enough text for windows of 512 tokens to rarely overlap
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    def summary(self, seed: int, dtype: str, threads: int, corpus_tokens: int) -> dict:
        return {
            "requests": len(self.prompts), "seed": seed, "transformers_dtype": dtype,
            "threads": threads,
            "prompt_tokens": sum(map(len, self.prompts)), "output_tokens": sum(self.output_lens),
            "prompt_len_range": [PROMPT_MIN, PROMPT_MAX],
            "output_len_range": [OUTPUT_MIN, OUTPUT_MAX],
            "prompt_len_lognormal": {"mu": PROMPT_MU, "sigma": PROMPT_SIGMA},
            "corpus": f"docstrings of the Python {sys.version_info.major}."
                      f"{sys.version_info.minor} standard library, {corpus_tokens} tokens",
            "ignore_eos": True,
        }


@dataclass
class Result:
    system: str
    output_tokens: int = 0
    seconds: float | None = None
    tokens: list[list[int]] = field(default_factory=list)  # per request, its useful output
    notes: str = ""
    error: str | None = None
    profile: dict | None = None  # step time breakdown, with --profile

    @property
    def tokens_per_s(self) -> float | None:
        return self.output_tokens / self.seconds if self.seconds else None

    def row(self) -> dict:
        row = {"system": self.system, "output_tokens": self.output_tokens,
               "seconds": self.seconds, "output_tokens_per_s": self.tokens_per_s}
        if self.notes:
            row["notes"] = self.notes
        if self.error:
            row["error"] = self.error
        if self.profile:
            row["profile"] = self.profile
        return row


@dataclass(frozen=True)
class Sampling:
    """Greedy (temperature 0) or temperature/top-p sampling, seeded per request."""

    temperature: float = 0.0
    top_p: float = 1.0
    base_seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def seed(self, request: int) -> int | None:
        return None if self.greedy else self.base_seed * 100_003 + request

    def transformers(self) -> dict:
        if self.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": 0}

    def summary(self) -> dict:
        if self.greedy:
            return {"greedy": True}
        return {"greedy": False, "temperature": self.temperature, "top_p": self.top_p,
                "seeded_per_request": True}


def stdlib_corpus(limit: int = CORPUS_CHARS) -> str:
    """Real English prose: module, class and function docstrings of the standard library,
    read with `ast` (nothing is imported), files in sorted order, so the text is the same on
    every machine with the same Python minor version."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    size = 0
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    parts.append(doc)
                    size += len(doc) + 2
        if size >= limit:
            break
    return "\n\n".join(parts)[:limit]


def make_workload(corpus_ids: list[int], requests: int, seed: int) -> Workload:
    """Prompt windows sliced out of the corpus at random offsets, log-normal lengths."""
    # separate streams: changing how prompts are drawn leaves the output lengths alone
    prompt_rng, output_rng = random.Random(seed), random.Random(f"outputs-{seed}")
    prompts, output_lens = [], []
    for _ in range(requests):
        length = round(prompt_rng.lognormvariate(PROMPT_MU, PROMPT_SIGMA))
        length = min(max(length, PROMPT_MIN), PROMPT_MAX)
        start = prompt_rng.randrange(len(corpus_ids) - length)
        prompts.append(corpus_ids[start:start + length])
        output_lens.append(output_rng.randint(OUTPUT_MIN, OUTPUT_MAX))
    return Workload(prompts, output_lens)


def peak_matmul_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """Best-of-N rate of one large square `torch.mm` in `dtype`: the roofline of this run."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)  # the first call pays for thread-pool and packing setup
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2.0 * n ** 3 / best


def run_sluice(engine, workload: Workload, sampling: Sampling, system: str,
               profile: bool = False) -> Result:
    """Every request submitted up front, then `step()` until none is left: the engine's own
    continuous batching with its default scheduler settings and KV pool."""
    from sluice.ipc.vocabulary import SamplingParams

    def params(n: int, seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=sampling.temperature,
                              top_p=sampling.top_p, seed=seed, ignore_eos=True)

    engine.generate([workload.prompts[0][:8]], params(2, 0))  # warm-up
    notes = f"{engine.runner.model.dtype} weights and KV".replace("torch.", "")

    def run() -> Result:
        started = time.perf_counter()
        ids = [engine.add_request(prompt_token_ids=p, sampling=params(n, sampling.seed(i)))
               for i, (p, n) in enumerate(zip(workload.prompts, workload.output_lens))]
        produced: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id in produced:
                    produced[out.request_id].extend(out.new_token_ids)
        seconds = time.perf_counter() - started
        tokens = [produced[i] for i in ids]
        return Result(system, sum(map(len, tokens)), seconds, tokens, notes=notes)

    if not profile:
        return run()
    from step_profile import attention_backend, profiled

    result, breakdown = profiled(engine, run)
    result.profile = {"attention_backend": attention_backend(), **breakdown}
    result.notes = f"{notes}; run under the torch profiler (--profile): slower than a plain run"
    return result


def load_transformers(model_path: Path, dtype: torch.dtype):
    """The same weights as dense `nn.Linear`s in `dtype`, as sluice holds them: a GGUF file is
    dequantized at load time rather than left packed for transformers' GGUF matmul kernels."""
    from transformers import AutoModelForCausalLM, GgufConfig

    if model_path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                     attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_path.parent, gguf_file=model_path.name, dtype=dtype, attn_implementation="sdpa",
            quantization_config=GgufConfig(dequantize=True))
    other = {str(p.dtype) for p in model.parameters() if p.dtype != dtype}
    if other:
        raise RuntimeError(f"transformers kept parameters in {sorted(other)}, not {dtype}")
    model.generation_config.eos_token_id = None  # never stop early: lengths are per request
    return model.eval()


def run_static(model, workload: Workload, batch_size: int, pad_id: int,
               sampling: Sampling) -> Result:
    """`generate` over static batches in arrival order, left padded with an attention mask.
    A batch runs for its longest request's output length; only each request's own length
    counts as useful output, the rest is the waste static batching pays."""
    from transformers import GenerationConfig

    def generate(prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
        width = max(map(len, prompts))
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        config = GenerationConfig(max_new_tokens=new_tokens, eos_token_id=None,
                                  pad_token_id=pad_id, **sampling.transformers())
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask,
                                 generation_config=config)
        generated = out[:, width:]
        if generated.shape[1] != new_tokens:
            raise RuntimeError(f"generate returned {generated.shape[1]} new tokens, "
                               f"asked for {new_tokens}")
        return generated

    generate([workload.prompts[0][:8]], 2)  # warm-up
    torch.manual_seed(sampling.base_seed)
    tokens: list[list[int]] = []
    started = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first:first + batch_size]
        lens = workload.output_lens[first:first + batch_size]
        generated = generate(prompts, max(lens))
        tokens.extend(generated[row, :n].tolist() for row, n in enumerate(lens))
    seconds = time.perf_counter() - started
    ran = sum(max(workload.output_lens[i:i + batch_size]) * len(workload.output_lens[i:i + batch_size])
              for i in range(0, len(workload.output_lens), batch_size))
    useful = sum(workload.output_lens)
    return Result(f"transformers-static-{batch_size}", useful, seconds, tokens,
                  notes=f"{ran - useful} padded output tokens generated and not counted")


def run_cb(model, workload: Workload, kv_bytes: int, token_budget: int,
           sampling: Sampling) -> Result:
    """transformers' ContinuousBatchingManager: every request added up front with its own
    max_new_tokens, results collected until all are finished. Its KV cache gets the same
    bytes and its batches the same token budget as sluice's defaults; on the host its own
    default would size the cache from 90% of system memory."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    text_config = model.config.get_text_config()
    head_dim = getattr(text_config, "head_dim", None) or (
        text_config.hidden_size // text_config.num_attention_heads)
    page_size = ContinuousBatchingConfig().page_size
    block_bytes = (2 * text_config.num_hidden_layers * text_config.num_key_value_heads
                   * head_dim * model.dtype.itemsize * page_size)
    cb_config = ContinuousBatchingConfig(num_blocks=max(2, kv_bytes // block_bytes),
                                         max_batch_tokens=token_budget,
                                         auto_switch_to_flash=False)
    gen_config = GenerationConfig(eos_token_id=-1, max_new_tokens=OUTPUT_MAX,
                                  **sampling.transformers())
    torch.manual_seed(sampling.base_seed)
    manager = model.init_continuous_batching(generation_config=gen_config,
                                             continuous_batching_config=cb_config)
    manager.start()
    try:
        def collect(ids: set[str]) -> dict[str, list[int]]:
            done: dict[str, list[int]] = {}
            while len(done) < len(ids):
                result = manager.get_result(timeout=1.0)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("the continuous batching loop stopped")
                    continue
                if result.request_id in ids and result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"request {result.request_id}: {result.error}")
                    done[result.request_id] = list(result.generated_tokens)
            return done

        manager.add_request(workload.prompts[0][:8], request_id="warm-up", max_new_tokens=2)
        collect({"warm-up"})
        started = time.perf_counter()
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
               for i, (p, n) in enumerate(zip(workload.prompts, workload.output_lens))]
        done = collect(set(ids))
        seconds = time.perf_counter() - started
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    tokens = [done[i] for i in ids]
    return Result("transformers-cb", sum(map(len, tokens)), seconds, tokens,
                  notes=f"attention {model.config._attn_implementation}, page size {page_size}, "
                        f"{cb_config.num_blocks} blocks, {token_budget} batch tokens")


def sluice_roofline(config, workload: Workload, result: Result, peak: float) -> dict:
    """FLOPs sluice actually needs: every prompt token and every fed-back output token runs
    the decoder body; only rows that sample a token run the vocabulary projection (prefill
    rows do not: sluice skips it). Attention score FLOPs are left out."""
    head = 2.0 * config.hidden_size * config.vocab_size
    body = config.flops_per_token() - head
    prompt_tokens = sum(map(len, workload.prompts))
    output_tokens = sum(workload.output_lens)
    processed = prompt_tokens + output_tokens - len(workload.prompts)  # last token never fed
    flops = processed * body + output_tokens * head
    per_output = flops / output_tokens
    at_roofline = peak / per_output
    row = {
        "flop_count": "matmul FLOPs: decoder body for prompt and fed-back output tokens, "
                      "vocabulary projection only for sampled tokens, attention scores excluded",
        "flops_per_token_body": body, "flops_per_token_lm_head": head,
        "flops_total": flops, "flops_per_output_token": per_output,
        "peak_flops_per_s": peak, "output_tokens_per_s_at_roofline": at_roofline,
    }
    if result.tokens_per_s is not None:
        row["share"] = result.tokens_per_s / at_roofline
    return row


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="transformers' dtype (sluice runs its default, sluice-fp32 float32)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy; else every system samples, seeded per request")
    parser.add_argument("--top-p", type=float, default=1.0)
    # measured on the default workload, 2 cores: 8 sequences 51.4 tok/s (24.9 tokens per
    # decode call), 16 49.7 (43.6), 32 46.0: its 4-bit matmuls gain little from larger batches
    parser.add_argument("--llama-parallel", type=int, default=8,
                        help="llama.cpp's parallel sequences (its server's -np; default: the "
                             "best measured here)")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="comma-separated subset of " + ", ".join(SYSTEMS)
                        + " (default: all), or " + ", ".join(DETERMINISTIC_SYSTEMS))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads for every system (default: all cores)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="sluice systems split the model across N rank processes, "
                             "sharing --threads among them")
    parser.add_argument("--part", default=None, metavar="K/N",
                        help="run only requests K, K+N, K+2N, ... of the workload (to run N "
                             "engines side by side, as replicas would)")
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded)")
    parser.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    parser.add_argument("--profile", action="store_true",
                        help="profile sluice's steps and print the share of each phase")
    parser.add_argument("--write-workload", metavar="FILE", default=None,
                        help="write the workload as JSON lines for `sluice bench --workload` "
                             "and exit")
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in (*SYSTEMS, *DETERMINISTIC_SYSTEMS)]
    if unknown or not args.systems:
        parser.error(f"--systems: unknown {unknown}; choose from "
                     f"{', '.join((*SYSTEMS, *DETERMINISTIC_SYSTEMS))}")
    if args.requests < 1:
        parser.error("--requests must be >= 1")
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    if args.tensor_parallel < 1:
        parser.error("--tensor-parallel must be >= 1")
    if args.part is not None:
        try:
            k, n = (int(x) for x in args.part.split("/"))
        except ValueError:
            parser.error(f"--part: K/N with whole numbers, not {args.part!r}")
        if not 0 <= k < n:
            parser.error(f"--part: K must be in 0..N-1, got {args.part!r}")
        args.part = (k, n)
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        parser.error("--temperature must be >= 0 and --top-p in (0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from sluice.actors.executor.loader import resolve_model_path
    from sluice.actors.executor.runner import DEFAULT_CPU_KV_BYTES
    from sluice.actors.scheduler import SchedulerConfig
    from sluice.actors.text import load_tokenizer

    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    import structlog  # the engine's own log lines go to stderr: stdout is the report

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    threads = args.threads
    torch.set_num_threads(threads)
    dtype = DTYPES[args.dtype]
    try:
        model_path = resolve_model_path(args.model)
    except Exception as exc:
        print(f"offline.py: --model: {exc}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(model_path)
    corpus_ids = tokenizer.encode(stdlib_corpus())
    workload = make_workload(corpus_ids, args.requests, args.seed)
    if args.part is not None:
        k, n = args.part
        workload = Workload(workload.prompts[k::n], workload.output_lens[k::n])
    if args.write_workload:
        with open(args.write_workload, "w") as handle:
            for prompt, n in zip(workload.prompts, workload.output_lens):
                handle.write(json.dumps({"prompt_ids": prompt, "max_tokens": n}) + "\n")
        return 0
    summary = workload.summary(args.seed, args.dtype, threads, len(corpus_ids))
    log(f"workload: {summary['requests']} requests, seed {args.seed}, "
        f"{summary['prompt_tokens']} prompt + {summary['output_tokens']} output tokens, "
        f"{args.dtype}, torch threads {threads}")
    sampling = Sampling(args.temperature, args.top_p, args.seed)
    summary.update(sampling.summary())
    peaks: dict[str, float] = {}

    def peak(dtype_name: str) -> float:
        if dtype_name not in peaks:
            peaks[dtype_name] = peak_matmul_flops(DTYPES[dtype_name])
            log(f"peak matmul ({dtype_name}, 2048x2048 torch.mm, best of 5): "
                f"{peaks[dtype_name] / 1e9:.1f} GFLOP/s")
        return peaks[dtype_name]

    results: list[Result] = []
    rooflines: dict[str, dict] = {}
    for system in (s for s in args.systems if s in SLUICE_SYSTEMS):
        try:
            from sluice.actors.engine import Engine

            from sluice.actors.executor.loader import read_model_config

            engine = Engine(model=args.model,
                            dtype="float32" if system.startswith("sluice-fp32") else "auto",
                            deterministic=system in DETERMINISTIC_SYSTEMS,
                            tensor_parallel=args.tensor_parallel)
            try:
                dtype_name = str(engine.runner.model.dtype).removeprefix("torch.")
                result = run_sluice(engine, workload, sampling, system, profile=args.profile)
            finally:
                engine.close()
            if args.tensor_parallel > 1:
                result.notes = f"{args.tensor_parallel} ranks; {result.notes}".rstrip("; ")
            results.append(result)
            if dtype_name in DTYPES:  # the whole model's FLOPs, not rank 0's shard's
                rooflines[system] = {"dtype": dtype_name, **sluice_roofline(
                    read_model_config(model_path), workload, result, peak(dtype_name))}
            del engine
        except Exception as exc:  # one broken system must not hide the others' numbers
            results.append(Result(system, error=f"{type(exc).__name__}: {exc}"))
        log(_line(results[-1]))
    peers = [s for s in args.systems if s.startswith("transformers")]
    model, load_error = None, None
    if peers:
        try:
            model = load_transformers(model_path, dtype)
        except Exception as exc:
            load_error = f"loading the transformers model: {type(exc).__name__}: {exc}"
        pad_id = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else 0
        for system in peers:
            try:
                if load_error:
                    raise RuntimeError(load_error)
                if system == "transformers-cb":
                    budget = int(SchedulerConfig().token_budget)
                    results.append(run_cb(model, workload, DEFAULT_CPU_KV_BYTES, budget,
                                          sampling))
                else:
                    batch = int(system.rsplit("-", 1)[1])
                    results.append(run_static(model, workload, batch, pad_id, sampling))
                results[-1].notes = f"{args.dtype}; {results[-1].notes}".rstrip("; ")
            except Exception as exc:
                results.append(Result(system, error=f"{type(exc).__name__}: {exc}"))
            log(_line(results[-1]))
        del model
    if "llama-cpp" in args.systems:
        results.append(run_llamacpp(model_path, workload, sampling, threads,
                                    args.llama_parallel))
        log(_line(results[-1]))

    report = {"workload": summary, "results": [r.row() for r in results]}
    ours = next((r for r in results if r.system == "sluice" and r.tokens_per_s), None)
    if ours is None:
        ours = next((r for r in results if r.system in SLUICE_SYSTEMS and r.tokens_per_s), None)
    if ours is not None:
        report["ratios"] = {f"{ours.system}/{r.system}": ours.tokens_per_s / r.tokens_per_s
                            for r in results if r is not ours and r.tokens_per_s}
        report["same_tokens_as_sluice"] = {
            r.system: sum(a == b for a, b in zip(ours.tokens, r.tokens))
            for r in results if r is not ours and r.tokens}
    if rooflines:
        report["roofline"] = rooflines
        report["peak_matmul_flops_per_s"] = peaks
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0 if all(r.error is None for r in results) else 1


def run_llamacpp(model_path: Path, workload: Workload, sampling: Sampling, threads: int,
                 parallel: int) -> Result:
    """llama.cpp through llama-cpp-python (the optional `bench` extra): see llamacpp.py."""
    from llamacpp import LlamaCppRunner, available

    missing = available()
    if missing:
        return Result("llama-cpp", error=missing)
    if model_path.is_dir():
        return Result("llama-cpp", error="llama.cpp runs GGUF files; --model is a folder")
    runner = LlamaCppRunner(model_path, threads=threads, parallel=parallel)
    try:
        runner.run([workload.prompts[0][:8]], [2])  # warm-up
        runner.decode_calls = runner.decoded_tokens = 0
        seeds = [sampling.seed(i) for i in range(len(workload.prompts))]
        seconds, tokens = runner.run(workload.prompts, workload.output_lens,
                                     temperature=sampling.temperature, top_p=sampling.top_p,
                                     seeds=None if sampling.greedy else seeds)
        per_call = runner.decoded_tokens / max(1, runner.decode_calls)
        info = runner.system_info()
    finally:
        runner.close()
    return Result("llama-cpp", sum(map(len, tokens)), seconds, tokens,
                  notes=f"GGUF weights as stored (4-bit for the embedded model); {parallel} "
                        f"parallel sequences, {per_call:.1f} tokens per llama_decode; "
                        f"system_info: {info}")


def _line(result: Result) -> str:
    if result.error:
        return f"  {result.system}: failed: {result.error}"
    return (f"  {result.system}: {result.output_tokens} output tokens in "
            f"{result.seconds:.2f} s")


def print_table(report: dict) -> None:
    ratios = report.get("ratios", {})
    same = report.get("same_tokens_as_sluice", {})
    requests = report["workload"]["requests"]
    print(f"\n{'system':<24}{'output tok':>11}{'seconds':>10}{'tok/s':>10}"
          f"{'sluice/x':>10}{'same as sluice':>16}")
    for row in report["results"]:
        if row.get("error"):
            print(f"{row['system']:<24}  error: {row['error']}")
            continue
        ratio = next((v for k, v in ratios.items() if k.endswith(f"/{row['system']}")), None)
        agree = same.get(row["system"])
        print(f"{row['system']:<24}{row['output_tokens']:>11}{row['seconds']:>10.2f}"
              f"{row['output_tokens_per_s']:>10.1f}"
              f"{(f'{ratio:.2f}x' if ratio else '-'):>10}"
              f"{(f'{agree}/{requests}' if agree is not None else '-'):>16}")
    for row in report["results"]:
        if row.get("notes"):
            print(f"  {row['system']}: {row['notes']}")
    for system, roof in report.get("roofline", {}).items():
        print(f"\n{system} roofline ({roof['dtype']}): peak "
              f"{roof['peak_flops_per_s'] / 1e9:.1f} GFLOP/s, "
              f"{roof['flops_per_output_token'] / 1e6:.0f} MFLOP per output token "
              f"(prompt share included) -> {roof['output_tokens_per_s_at_roofline']:.1f} "
              f"output tok/s at roofline")
        if "share" in roof:
            print(f"{system} reaches {100 * roof['share']:.1f}% of its dtype's roofline")
    for row in report["results"]:
        if row.get("profile"):
            from step_profile import print_breakdown

            print(f"\n{row['system']}:")
            print_breakdown(row["profile"], row["profile"]["attention_backend"])


if __name__ == "__main__":
    sys.exit(main())
