"""What a `sluice bench` run ran against, for its report's `run` object and text header.

The load as it was asked for (the arrival process, when it stops), the prompt and output
lengths of the completed requests as the daemon counted them in each one's usage, and, with
`--connect-control`, what the daemon runs (its version, model, executor, device, dtypes and
scheduler settings, from its control socket's `StatusReport`) and its KV use while the load
ran: the status is sampled every `KV_SAMPLE_INTERVAL` seconds (the first a quarter of that
after the load starts, so a short load is seen full) and the most blocks in use at any
sample kept, before and after the load included. Samples miss what happens between them:
the peak is at most the true one, and `samples` says how many were taken during the load.

Also each request's `Sample`, as both fronts' load drivers record it.

What does not belong here: driving the load and the latency report (see `bench`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import trio

from sluice.daemon import version
from sluice.ipc import messages as m
from sluice.ipc.codec import to_plain
from sluice.ipc.control import fetch_status

KV_SAMPLE_INTERVAL = 0.2  # seconds between status samples while the load runs


class DaemonWatch:
    """The daemon's status before, during and after a load, from its control socket."""

    def __init__(self, address: str, interval: float = KV_SAMPLE_INTERVAL):
        self.address = address
        self.interval = interval
        self.first: m.StatusReport | None = None
        self.last: m.StatusReport | None = None
        self.peak_used_blocks = 0
        self.samples = 0  # taken while the load ran (`run`), not before or after it

    async def sample(self) -> m.StatusReport:
        report = await fetch_status(self.address)
        self.first = self.first or report
        self.last = report
        self.peak_used_blocks = max(self.peak_used_blocks, report.kv.used_blocks)
        return report

    async def run(self) -> None:
        """Sample until cancelled (the load ended)."""
        await trio.sleep(self.interval / 4)
        while True:
            await self.sample()
            self.samples += 1
            await trio.sleep(self.interval)

    @property
    def preemptions(self) -> int:
        return self.last.counters.preemptions - self.first.counters.preemptions


def distribution(values: list[int]) -> dict[str, float | int | None]:
    """count, min, p50, p90, p99, max and mean; nearest-rank percentiles."""
    if not values:
        return {"count": 0, "min": None, "p50": None, "p90": None, "p99": None, "max": None,
                "mean": None}
    ordered = sorted(values)

    def pick(q: float) -> int:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {"count": len(ordered), "min": ordered[0], "p50": pick(0.50), "p90": pick(0.90),
            "p99": pick(0.99), "max": ordered[-1], "mean": sum(ordered) / len(ordered)}


def arrival(args: argparse.Namespace, requests: int | None) -> dict:
    if args.rate:
        process = {"process": "poisson", "rate": args.rate}
    else:
        process = {"process": "closed", "concurrency": args.concurrency or 16}
    return {**process, "requests": requests, "duration": args.duration}


def daemon_record(watch: DaemonWatch) -> dict:
    facts, last = watch.last.daemon, watch.last
    return {
        "version": facts.version or None,
        "model": facts.model or None,
        "model_path": facts.model_path or None,
        "executor": facts.executor or None,
        "device": facts.device or None,
        "dtype": last.worker.dtype or None,
        "kv_dtype": last.worker.kv_dtype or None,
        "scheduler": to_plain(facts.scheduler),
        "kv": {"total_blocks": last.kv.total_blocks, "peak_used_blocks": watch.peak_used_blocks,
               "used_blocks_at_end": last.kv.used_blocks, "samples": watch.samples,
               "sample_interval": watch.interval},
    }


def run_record(args: argparse.Namespace, requests: int | None, prompt_tokens: list[int],
               output_tokens: list[int], watch: DaemonWatch | None) -> dict:
    """The report's `run`: what this bench ran against, and how."""
    return {
        "sluice_version": version() or None,
        "target": {"http": args.http} if args.http else {"connect": args.connect},
        "arrival": arrival(args, requests),
        "prompt_tokens": distribution(prompt_tokens),
        "output_tokens": distribution(output_tokens),
        "daemon": None if watch is None else daemon_record(watch),
    }


def header(run: dict) -> list[str]:
    """The text report's first lines."""
    load = run["arrival"]
    shape = (f"poisson {load['rate']:g} req/s" if load["process"] == "poisson"
             else f"closed loop, {load['concurrency']} in flight")
    until = (f"{load['requests']} requests" if load["requests"] is not None
             else f"{load['duration']:g}s")
    lines = [f"sluice {run['sluice_version'] or '?'} bench: {shape}, {until}"]
    for name in ("prompt_tokens", "output_tokens"):
        d = run[name]
        if d["count"]:
            lines.append(f"{name.split('_')[0]:7s} tokens min {d['min']}  p50 {d['p50']}  "
                         f"p90 {d['p90']}  p99 {d['p99']}  max {d['max']}  "
                         f"mean {d['mean']:.1f}")
    daemon = run["daemon"]
    if daemon is None:
        lines.append("daemon  not recorded (give --connect-control to record it)")
        return lines
    s, kv = daemon["scheduler"], daemon["kv"]
    lines.append(f"daemon  sluice {daemon['version'] or '?'}  model {daemon['model']}  "
                 f"executor {daemon['executor']}  device {daemon['device'] or '-'}  "
                 f"dtype {daemon['dtype'] or '-'}")
    lines.append(f"sched   {s['policy']}  token_budget {s['token_budget']:g}  max_running "
                 f"{s['max_running']}  max_prefilling {s['max_prefilling']}  prefill_chunk "
                 f"{s['max_prefill_chunk']}  block_size {s['block_size']}")
    lines.append(f"kv      peak {kv['peak_used_blocks']}/{kv['total_blocks']} blocks  "
                 f"end {kv['used_blocks_at_end']}  (sampled {kv['samples']}x during the load)")
    return lines


@dataclass
class Sample:
    tenant: str
    start: float
    ttft: float | None = None
    e2e: float = 0.0
    tokens: int = 0
    itl: list[float] = field(default_factory=list)
    rejected: str | None = None  # the refusal code
    finish_reason: str | None = None
    # as the daemon counted them in the request's usage; None until it said
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.tokens - 1)
