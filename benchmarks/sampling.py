"""Sampling cost: the full-vocabulary race alone, torch against the fused op, and an engine
run sampled against the same run greedy.

    python benchmarks/sampling.py [--rows 1,8,32,64] [--vocab 49152] [--repeats 5]
                                  [--requests 16] [--max-tokens 16] [--temperature 0.8]
                                  [--top-p 1.0]
                                  [--rounds 2] [--dtype auto|float32|bfloat16] [--skip-engine]

Race: `sampler.race_whole_vocabulary` on random logits (rows x vocab, float32, on CPU; on
CUDA too when there is one), the torch code (`fused=False`) and the fused op (C++ on CPU,
Triton on CUDA), best of `--repeats` after a warm-up; the two must pick the same tokens.

Engine: the in-process `Engine` (embedded model, `--dtype`) on `--requests` prompts of random
token ids (flat distributions: every sampled row races over the whole vocabulary, as a
request with OpenAI's default top_p = 1 does), all added up front and stepped to the end,
EOS ignored: greedy, then `--temperature` (and `--top-p`: on these flat distributions a
nucleus of 0.9 still holds far more than the 256 candidates a narrow one is cut from, so it
races too) with the torch race (`SLUICE_FUSED_RACE=off`),
then with the fused op, the three in turn for `--rounds` rounds. Output tokens/s, the best
round of each, after a warm-up request.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def time_best(fn, repeats: int, sync) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - started)
    return best


def race_section(rows_list: list[int], vocab: int, repeats: int, device: str) -> None:
    from sluice.actors.executor.sampler import race_whole_vocabulary
    from sluice.kernels import race

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fused_on = race.available(torch.device(device))
    print(f"race over {vocab} tokens on {device} "
          f"(fused op {'available' if fused_on else 'UNAVAILABLE: torch both times'}):")
    print(f"{'rows':>6} {'torch ms':>10} {'fused ms':>10} {'speed-up':>9}  same tokens")
    generator = torch.Generator().manual_seed(0)
    for rows in rows_list:
        logits = (torch.randn(rows, vocab, generator=generator) * 2).to(device)
        temperature = torch.full((rows,), 0.8, device=device)
        min_p = torch.zeros(rows, device=device)
        keys = torch.randint(0, 1 << 32, (rows, 2), generator=generator).to(device)
        results = {}

        def run(fused: bool):
            results[fused] = race_whole_vocabulary(logits, temperature, keys, min_p,
                                                   fused=fused)

        slow = time_best(lambda: run(False), repeats, sync)
        fast = time_best(lambda: run(True), repeats, sync)
        same = torch.equal(results[False], results[True])
        print(f"{rows:>6} {slow * 1e3:>10.2f} {fast * 1e3:>10.2f} {slow / fast:>8.1f}x  {same}")


def engine_section(args) -> None:
    from sluice.actors.engine import Engine
    from sluice.ipc.vocabulary import SamplingParams
    from sluice.kernels import race

    engine = Engine(dtype=args.dtype)
    vocab = engine.runner.model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (int(n),), generator=generator).tolist()
               for n in torch.randint(16, 128, (args.requests,), generator=generator)]
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.8, seed=0))

    def run(temperature: float) -> tuple[float, list[list[int]]]:
        top_p = args.top_p if temperature else 1.0
        params = [SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=i,
                                 top_p=top_p, ignore_eos=True) for i in range(len(prompts))]
        started = time.perf_counter()
        done = engine.generate(prompts, params)
        seconds = time.perf_counter() - started
        tokens = [c.token_ids for c in done]
        return sum(map(len, tokens)) / seconds, tokens

    print(f"engine: {args.requests} random-token prompts, {args.max_tokens} tokens each, "
          f"{engine.runner.model.dtype}, torch threads {torch.get_num_threads()}:")
    best = {"greedy": 0.0, "torch": 0.0, "fused": 0.0}
    tokens = {}
    saved = os.environ.get(race.DISABLE_ENV)
    try:
        for _ in range(args.rounds):
            best["greedy"] = max(best["greedy"], run(0.0)[0])
            os.environ[race.DISABLE_ENV] = "off"
            rate, tokens["torch"] = run(args.temperature)
            best["torch"] = max(best["torch"], rate)
            os.environ.pop(race.DISABLE_ENV)
            rate, tokens["fused"] = run(args.temperature)
            best["fused"] = max(best["fused"], rate)
    finally:
        os.environ.pop(race.DISABLE_ENV, None)
        if saved is not None:
            os.environ[race.DISABLE_ENV] = saved
    greedy = best["greedy"]
    print(f"  greedy                         {greedy:8.1f} tok/s")
    for name in ("torch", "fused"):
        print(f"  temperature {args.temperature}, top_p {args.top_p}, {name} race "
              f"{best[name]:8.1f} tok/s "
              f"({best[name] / greedy:.0%} of greedy)")
    print(f"  the fused race drew the torch race's tokens: {tokens['fused'] == tokens['torch']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    race_section(rows, args.vocab, args.repeats, "cpu")
    if torch.cuda.is_available():
        race_section(rows, args.vocab, args.repeats, "cuda")
    if not args.skip_engine:
        engine_section(args)


if __name__ == "__main__":
    main()
