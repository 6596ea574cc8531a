"""Structured outputs' cost: one sampled workload, with a JSON schema on every request and
without, in the in-process engine (the worker's runner and sampler, which is where a
grammar costs anything: the fronts check a schema once and cache the answer).

Each run is `--requests` chat prompts submitted at once (concurrency = requests), sampled
at temperature 1.0 and top-p 0.95 with a seed per request, up to `--max-tokens` each; the
rate is completion tokens over the wall time from the first submission to the last end,
model loading and a warm-up excluded. The constrained run also reports the grammar work per
step: the time to compute the batch's masks (on a thread, while the forward runs) and the
time the step still waited for them after its forward (what the overlap did not hide).

Then what a new grammar costs everyone else: `--streams` unconstrained requests decode, and
`--new-grammars` requests arrive, each with a large JSON schema never seen before (200
integer properties, whose matcher takes tens of milliseconds or more to build). Reported: the
median step time before they arrive, and the longest step from their arrival until each has
sampled its first token (a step that waited for a build shows it).

    python benchmarks/structured.py [--requests 64] [--max-tokens 64] [--dtype float32]
                                    [--threads N] [--streams 8] [--new-grammars 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16},
                    "maxItems": 4},
        "pet": {"enum": ["cat", "dog", "fish", "none"]},
    },
    "required": ["name", "age", "city", "hobbies", "pet"],
    "additionalProperties": False,
}


def workload(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Describe person number {i} as a JSON object with "
              "name, age, city, hobbies and pet."}] for i in range(count)]


def big_schema(variant: int, properties: int = 200) -> dict:
    props = {f"v{variant}_p{i}": {"type": "integer", "minimum": i, "maximum": 10**6 + i}
             for i in range(properties)}
    return {"type": "object", "properties": props, "required": list(props)}


def new_grammar_stall(engine, streams: int, arrivals: int) -> dict:
    """Step times of `streams` decoding requests before and while `arrivals` requests with
    new grammars join them (see the module's docstring)."""
    import statistics

    from sluice.ipc.vocabulary import SamplingParams, grammar_of

    running = [engine.add_request(f"Count slowly from {i}:", sampling=SamplingParams(
        max_tokens=4096, temperature=0.0, ignore_eos=True)) for i in range(streams)]

    def timed_step() -> tuple[float, list]:
        started = time.perf_counter()
        outputs = engine.step()
        return time.perf_counter() - started, outputs

    before = [timed_step()[0] for _ in range(40)][10:]  # the prompts are done by then
    waiting = set()
    for i in range(arrivals):
        kind, text = grammar_of(json_schema=big_schema(i))
        waiting.add(engine.add_request(
            f"Fill in the numbers, form {i}:",
            sampling=SamplingParams(max_tokens=4, temperature=0.0, grammar_kind=kind,
                                    grammar=text)))
    during = []
    while waiting:
        seconds, outputs = timed_step()
        during.append(seconds)
        waiting -= {out.request_id for out in outputs if out.new_token_ids or out.finished}
    for request_id in running:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return {"streams": streams, "new_grammars": arrivals,
            "median_step_ms_before": round(1000 * statistics.median(before), 1),
            "longest_step_ms_while_built": round(1000 * max(during), 1),
            "step_ms_until_all_sampled": [round(1000 * t, 1) for t in during]}


def run(engine, prompts, params) -> dict:
    started = time.perf_counter()
    results = engine.generate(prompts, params, chat=True)
    seconds = time.perf_counter() - started
    tokens = sum(len(r.token_ids) for r in results)
    stopped = sum(1 for r in results if r.finish_reason == "stop")
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds,
            "stopped": stopped, "texts": [r.text for r in results]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--new-grammars", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from sluice.actors.engine import Engine
    from sluice.actors.executor import grammar
    from sluice.ipc.vocabulary import SamplingParams, grammar_of

    engine = Engine(None, dtype=args.dtype, device=args.device)
    kind, text = grammar_of(json_schema=SCHEMA)

    def params(constrained: bool) -> list[SamplingParams]:
        extra = {"grammar_kind": kind, "grammar": text} if constrained else {}
        return [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, top_p=0.95,
                               seed=1000 + i, **extra) for i in range(args.requests)]

    prompts = workload(args.requests)
    run(engine, prompts[:4], params(True)[:4])  # warm-up: kernels, the grammar engine
    timings: dict = {"masks": [], "waits": []}
    masks = grammar.Constraints.masks

    def timed_masks(self, seqs):
        started = time.perf_counter()
        try:
            return masks(self, seqs)
        finally:
            if any(s.sampling.constrained for s in seqs):
                timings["masks"].append(time.perf_counter() - started)
                timings["mask_end"] = time.perf_counter()

    grammar.Constraints.masks = timed_masks
    runner = engine.runner
    forward, execute = runner.forward_logits, runner.execute

    def timed_forward(plan):
        logits = forward(plan)
        timings["forward_end"] = time.perf_counter()
        return logits

    def timed_execute(plan):
        timings.pop("mask_end", None)
        result = execute(plan)
        if "mask_end" in timings:  # how long the sampler waited for the masks
            timings["waits"].append(max(0.0, timings["mask_end"] - timings["forward_end"]))
        return result

    runner.forward_logits, runner.execute = timed_forward, timed_execute
    free = run(engine, prompts, params(False))
    timings["masks"].clear()
    timings["waits"].clear()
    constrained = run(engine, prompts, params(True))
    valid = 0
    for text_out in constrained["texts"]:
        try:
            json.loads(text_out)
            valid += 1
        except ValueError:
            pass
    steps = len(timings["masks"])
    mask_ms = 1000 * sum(timings["masks"]) / max(1, steps)
    report = {
        "requests": args.requests, "max_tokens": args.max_tokens, "dtype": args.dtype,
        "device": args.device, "threads": torch.get_num_threads(),
        "unconstrained_tok_s": round(free["tok_s"], 1),
        "constrained_tok_s": round(constrained["tok_s"], 1),
        "ratio": round(constrained["tok_s"] / free["tok_s"], 3),
        "unconstrained_tokens": free["tokens"], "constrained_tokens": constrained["tokens"],
        "constrained_stopped": constrained["stopped"], "constrained_parsed": valid,
        "steps_with_masks": steps, "mask_ms_per_step": round(mask_ms, 3),
        "mask_wait_ms_per_step": round(1000 * sum(timings["waits"]) / max(1, steps), 3),
    }
    runner.forward_logits, runner.execute = forward, execute
    grammar.Constraints.masks = masks
    report["new_grammars"] = new_grammar_stall(engine, args.streams, args.new_grammars)
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>22}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
