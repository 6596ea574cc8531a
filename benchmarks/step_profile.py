"""Where a sluice step's time goes, for `offline.py --profile`: a torch profiler run with
named ranges around the runner's phases, folded into shares of step time.

The ranges are put in by wrapping the phase functions for the length of the profiled run
only (`instrumented`), so nothing of this sits on the hot path of a normal run. Phases:
input preparation (`ModelRunner._prepare`), KV write (`kernels.reshape_and_cache`),
attention (`kernels.paged_attention`), sampling (the runner's `sample`), and for a
tensor-parallel engine the collectives (rank 0's all-reduces, the logits' gather and the
plan's broadcast, waits included: this profiles rank 0 only); the rest of the
model's tensor ops are split into GEMMs and elementwise (norms, rotary, activations, the
embedding lookup); Python/other is step time none of those account for (the scheduler,
Python between ops, profiler overhead).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile, record_function

STEP = "sluice::step"
PHASES = {  # range name -> row of the breakdown
    "sluice::input_preparation": "input preparation",
    "sluice::kv_write": "KV write",
    "sluice::attention": "attention",
    "sluice::sampling": "sampling",
    "sluice::collectives": "collectives",
}
GEMM_OPS = {"aten::linear", "aten::matmul", "aten::mm", "aten::addmm", "aten::bmm",
            "aten::baddbmm", "mkldnn::_linear_pointwise"}
_ABSENT = object()
ROWS = ("GEMMs", "attention", "KV write", "elementwise", "sampling", "input preparation",
        "collectives", "Python/other")


def _ranged(name: str, function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with record_function(name):
            return function(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def instrumented(engine):
    """Wrap the engine's step and the runner's phases in named ranges, then restore them."""
    from sluice import kernels
    from sluice.actors.executor import runner

    targets = [(kernels, "paged_attention", "sluice::attention"),
               (kernels, "reshape_and_cache", "sluice::kv_write"),
               (runner, "sample", "sluice::sampling"),
               (runner.ModelRunner, "_prepare", "sluice::input_preparation"),
               (engine, "step", STEP)]
    if hasattr(engine.runner, "rank_pids"):  # a tensor-parallel group: rank 0's side of it
        model = engine.runner.model
        targets += [(model, "all_reduce", "sluice::collectives"),
                    (model, "gather_logits", "sluice::collectives"),
                    (engine.runner, "_send", "sluice::collectives")]
    patched = []
    try:
        for owner, attr, name in targets:
            patched.append((owner, attr, owner.__dict__.get(attr, _ABSENT)))
            setattr(owner, attr, _ranged(name, getattr(owner, attr)))
        yield
    finally:
        for owner, attr, original in reversed(patched):
            if original is _ABSENT:  # an instance attribute shadowing its class's method
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)


def _enclosing_range(event):
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in PHASES or parent.name == STEP:
            return parent.name
        parent = parent.cpu_parent
    return None


def _is_top_op(event) -> bool:
    """An operator not called from inside another operator (its time is not counted twice)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in PHASES or parent.name == STEP:
            return True
        if "::" in parent.name:
            return False
        parent = parent.cpu_parent
    return True


def breakdown(events) -> dict:
    """Seconds and shares of step time per row, plus the attention phase's own top ops."""
    seconds = Counter()
    attention_ops = Counter()
    steps = 0
    for event in events:
        if event.name == STEP:
            seconds["step"] += event.cpu_time_total
            steps += 1
        elif event.name in PHASES and _enclosing_range(event) == STEP:
            seconds[PHASES[event.name]] += event.cpu_time_total
        elif "::" in event.name and _is_top_op(event):
            where = _enclosing_range(event)
            if where == "sluice::attention":
                attention_ops[event.name] += event.cpu_time_total
            elif where == STEP:
                seconds["GEMMs" if event.name in GEMM_OPS else "elementwise"] += (
                    event.cpu_time_total)
    step = seconds["step"]
    seconds["Python/other"] = step - sum(seconds[row] for row in ROWS if row != "Python/other")
    return {
        "steps": steps, "step_seconds": step / 1e6,
        "rows": {row: {"seconds": seconds[row] / 1e6,
                       "share": seconds[row] / step if step else 0.0} for row in ROWS},
        "attention_ops": {name: us / 1e6 for name, us in attention_ops.most_common(6)},
    }


def profiled(engine, run):
    """`run()` under the profiler with the phase ranges; returns (run's result, breakdown)."""
    with instrumented(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
        result = run()
    return result, breakdown(prof.events())


def print_breakdown(report: dict, backend: str) -> None:
    print(f"\nsluice step profile ({report['steps']} steps, "
          f"{report['step_seconds']:.2f} s under the profiler, attention backend {backend}):")
    for row, numbers in report["rows"].items():
        print(f"  {row:<20}{100 * numbers['share']:>6.1f} %{numbers['seconds']:>10.3f} s")
    if report["attention_ops"]:
        print("  inside attention: " + ", ".join(
            f"{name} {secs:.3f} s" for name, secs in report["attention_ops"].items()))


def attention_backend() -> str:
    from sluice import kernels

    return kernels.backend_for(torch.empty(1))
