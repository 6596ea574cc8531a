"""Time one scheduler iteration (schedule() + update()) at serving scale, without a model.

Default: 256 running sequences decoding, 1,000 more waiting, prefix caching on, the default
policy. Prints milliseconds per iteration; the target is <= 1 ms at 256 running sequences.
Python's collector is set as the daemon sets it once it serves (`sluice.daemon.heap`).

    python benchmarks/scheduler.py [--running 256] [--waiting 1000] [--iterations 500]
                                   [--policy fair] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from sluice.actors.scheduler import Request, Scheduler, SchedulerConfig
from sluice.actors.scheduler.plan import StepResult
from sluice.ipc.vocabulary import SamplingParams
from sluice.daemon.heap import settle_collector


def build(running: int, waiting: int, policy: str, prompt_len: int, iterations: int) -> Scheduler:
    block_size = 16
    tokens_per_seq = prompt_len + 2 * iterations + 1024  # nobody finishes while timed
    config = SchedulerConfig(
        policy=policy,
        token_budget=max(512, running + 64),
        max_running=running,
        max_prefilling=8,
        max_prefill_chunk=512,
        kv_blocks=(running + 8) * (tokens_per_seq // block_size + 2),
        block_size=block_size,
        max_queued=running + waiting + 1,
        tenants={},
    )
    sched = Scheduler(config, max_model_len=tokens_per_seq + 1)
    sampling = SamplingParams(
        max_tokens=tokens_per_seq - prompt_len, temperature=0.0, ignore_eos=True
    )
    for i in range(running + waiting):
        prompt = [(i * 7919 + j) % 50_000 for j in range(prompt_len)]
        sched.add_request(Request(f"r{i}", prompt, sampling, tenant=f"t{i % 4}"))
    # admit and prefill the first `running` requests, then stop at a steady decode state
    while len(sched.running) < running or sched.prefilling:
        iterate(sched)
    return sched


def iterate(sched: Scheduler) -> int:
    plan = sched.schedule()
    sampled = {s.request_id: 11 for s in plan.seqs if s.sample}
    sched.update(plan, StepResult(plan.step_id, sampled))
    return len(plan.seqs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--waiting", type=int, default=1000)
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--policy", default="fair", choices=("fcfs", "priority", "srpt", "fair"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    sched = build(args.running, args.waiting, args.policy, args.prompt_len, args.iterations)
    settle_collector()
    samples, cpu_samples = [], []
    batch = 0
    for _ in range(args.iterations):
        start, cpu_start = time.perf_counter(), time.thread_time()
        batch = iterate(sched)
        samples.append((time.perf_counter() - start) * 1000.0)
        cpu_samples.append((time.thread_time() - cpu_start) * 1000.0)
    sched.check_invariants()
    result = {
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "batch": batch,
        "policy": args.policy,
        "iterations": args.iterations,
        "ms_per_iteration_mean": statistics.fmean(samples),
        "ms_per_iteration_p50": statistics.median(samples),
        "ms_per_iteration_p99": sorted(samples)[int(0.99 * (len(samples) - 1))],
        # CPU time of this thread: what the iteration costs when other processes share the cores
        "cpu_ms_per_iteration_mean": statistics.fmean(cpu_samples),
        "target_ms": 1.0,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"scheduler iteration with {result['running']} running, {result['waiting']} waiting "
            f"({args.policy}): mean {result['ms_per_iteration_mean']:.3f} ms, "
            f"p50 {result['ms_per_iteration_p50']:.3f} ms, "
            f"p99 {result['ms_per_iteration_p99']:.3f} ms, "
            f"CPU mean {result['cpu_ms_per_iteration_mean']:.3f} ms (target <= 1 ms)"
        )


if __name__ == "__main__":
    main()
