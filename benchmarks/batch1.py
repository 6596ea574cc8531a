"""Batch-1 decode against the memory bandwidth: one sequence of a Llama-3.2-1B-shaped model
(random weights, bfloat16 by default) decoding token by token, the case a desktop user runs.

Every decode step reads every layer weight and lm_head once, plus the sequence's KV, so the
bound is the bytes a token reads over the machine's memory bandwidth, measured in the same run
(best of five over 1 GiB): as a copy (bytes read plus bytes written, per second) and as a sum
(bytes read). A decode mostly reads, so the sum's rate is the bound; the copy's is lower.
The steps run through the worker's `ModelRunner.execute` (forward, greedy sampling), with no
scheduler or sockets around them. llama.cpp is not run on this shape: its Python binding is
built only by the `bench` extra (a compile of llama.cpp), and the random weights would first
have to be written as a GGUF; `offline.py` compares with llama.cpp on the embedded model.

    .venv/bin/python benchmarks/batch1.py [--tokens 64] [--prompt 128] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from sluice.actors.executor.config import ModelConfig
from sluice.actors.executor.runner import ModelRunner
from sluice.actors.scheduler.plan import ScheduledSeq, StepPlan
from sluice.ipc.vocabulary import SamplingParams

# Llama 3.2 1B (tied embeddings, GQA 32/8); its rope scaling changes no cost, so it is left out
LLAMA_3_2_1B = ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                           num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                           rope_theta=500000.0, max_position_embeddings=131072,
                           tie_word_embeddings=True)
BLOCK_SIZE = 16


def memory_bandwidth(gib: float = 1.0, repeats: int = 5) -> tuple[float, float]:
    """Bytes per second of the best of `repeats` passes over `gib` GiB: a copy (bytes read
    plus bytes written) and a sum (bytes read)."""
    source = torch.ones(int(gib * 2 ** 30) // 4)
    target = torch.zeros_like(source)
    copy = read = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        copy = min(copy, time.perf_counter() - started)
        started = time.perf_counter()
        source.sum()
        read = min(read, time.perf_counter() - started)
    size = source.numel() * 4
    return 2 * size / copy, size / read


def weight_bytes_per_token(runner: ModelRunner) -> int:
    """The bytes one decode step reads of the weights: every layer matmul and lm_head (its
    packed copy where tied), the norms, and one embedding row."""
    model, config = runner.model, runner.config
    size = torch.tensor([], dtype=model.dtype).element_size()
    h = config.hidden_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size + 2 * h
    return size * (config.num_layers * per_layer + config.vocab_size * h + 2 * h)


def kv_bytes(runner: ModelRunner, context: int) -> int:
    """The bytes of KV a decode step at `context` tokens reads."""
    return context * runner.bytes_per_block // runner.block_size


def decode(runner: ModelRunner, prompt: int, tokens: int) -> tuple[list[float], int]:
    """The seconds of each decode step of one sequence after a `prompt`-token prefill, and the
    context of the last step."""
    greedy = SamplingParams(temperature=0.0)
    blocks = list(range(-(-(prompt + tokens) // BLOCK_SIZE)))
    ids = [(7 * i + 1) % runner.config.vocab_size for i in range(prompt)]
    result = runner.execute(StepPlan(0, [ScheduledSeq("r", ids, 0, blocks, True, greedy)]))
    token, position, times = result.sampled["r"], prompt, []
    for step in range(tokens):
        plan = StepPlan(step + 1, [ScheduledSeq("r", [token], position, blocks, True, greedy,
                                                num_generated=step + 1)])
        started = time.perf_counter()
        token = runner.execute(plan).sampled["r"]
        times.append(time.perf_counter() - started)
        position += 1
    return times, position


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="decode steps timed")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens before them")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: all cores)")
    parser.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import structlog  # the model's own log lines go to stderr: stdout is the report

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))

    def say(text: str) -> None:
        print(text, file=sys.stderr if args.json else sys.stdout, flush=True)

    say(f"building a Llama-3.2-1B-shaped model, random {args.dtype} weights ...")
    blocks = -(-(args.prompt + args.tokens) // BLOCK_SIZE)
    runner = ModelRunner.from_config(LLAMA_3_2_1B, dtype=args.dtype, device="cpu",
                                     num_blocks=blocks, block_size=BLOCK_SIZE)
    copy, bandwidth = memory_bandwidth()
    decode(runner, args.prompt, 4)  # warm-up: kernels made, pages touched
    times, context = decode(runner, args.prompt, args.tokens)
    step = sorted(times)[len(times) // 2]
    read = weight_bytes_per_token(runner) + kv_bytes(runner, context)
    report = {
        "shape": "llama-3.2-1b", "dtype": args.dtype, "threads": torch.get_num_threads(),
        "prompt_tokens": args.prompt, "decode_tokens": args.tokens,
        "median_step_s": step, "tokens_per_s": 1.0 / step,
        "bytes_per_token": read, "read_bandwidth_bytes_per_s": bandwidth,
        "copy_bandwidth_bytes_per_s": copy, "bound_tokens_per_s": bandwidth / read,
        "share_of_bandwidth": read / step / bandwidth, "share_of_copy": read / step / copy,
        "packed_weights": runner.model.packed,
    }
    if args.json:
        print(json.dumps(report))
    else:
        say(f"decode at batch 1: {report['tokens_per_s']:.2f} tok/s (median step "
            f"{step * 1e3:.1f} ms, {args.tokens} steps after a {args.prompt}-token prompt)")
        say(f"reads {read / 1e9:.2f} GB a token; read bandwidth {bandwidth / 1e9:.1f} GB/s -> "
            f"bound {report['bound_tokens_per_s']:.2f} tok/s; sluice moves "
            f"{report['share_of_bandwidth']:.0%} of it ({report['share_of_copy']:.0%} of a "
            f"copy's {copy / 1e9:.1f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
