"""Latency bookkeeping of the scheduler actor: time to first token, inter-token latency,
iteration times, for `sluice status`, the console and the metrics histograms.

The histograms are kept here, by the actor that sees the samples, and leave it only inside
the snapshots it is asked for: the metrics render what a snapshot says."""

from __future__ import annotations

import bisect
import itertools
from collections import deque

from sluice.actors.scheduler.scheduler import Scheduler
from sluice.actors.scheduler.plan import StepOutputs, StepPlan


LATENCY_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                  10.0, 30.0)  # seconds
TOKEN_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
BATCH_BOUNDS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
HISTOGRAM_BOUNDS = {"itl": LATENCY_BOUNDS, "iteration": LATENCY_BOUNDS,
                    "prefill_chunk": TOKEN_BOUNDS, "decode_batch": BATCH_BOUNDS}


class Buckets:
    """One histogram: `counts[i]` values in (bounds[i-1], bounds[i]], a last count above
    every bound, and their sum."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def add(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.total += value * count


class LatencyLog:
    """Time to first token, inter-token latency and output tokens, from the outputs emitted.

    Keeps the latest samples for percentiles (time to first token as the scheduler sees it,
    for `sluice status` and the console) and, with `histograms`, a histogram per kind (`itl`,
    `iteration`, `decode_batch`, `prefill_chunk`) and tenant; the time-to-first-token
    histogram is the Usage actor's, to the moment the token left the daemon: `buckets`, keyed
    `(kind, tenant)`. The tenant is "" for a tenant no config or operator created (and for
    the per-step kinds), so label sets stay bounded whatever names clients invent.
    """

    def __init__(self, keep: int = 2048, *, histograms: bool = False):
        self.ttft: deque[float] = deque(maxlen=keep)
        self.itl: deque[float] = deque(maxlen=keep)
        # (time, tokens) per step that produced any: per output, 2,048 entries held only the
        # last few steps of a busy daemon, and the rate over 5 s read far too low
        self.tokens: deque[tuple[float, int]] = deque(maxlen=keep)
        self.output_tokens = 0
        # request id -> [time of its last token, its histogram label], looked up once and
        # updated in place
        self.last_token: dict[str, list] = {}
        self.histograms = histograms
        self.buckets: dict[tuple[str, str], Buckets] = {}

    def record(self, core: Scheduler, outputs: StepOutputs) -> None:
        now = core.clock()
        produced = 0
        last_token = self.last_token
        # (time of the previous token, label, tokens) -> requests: the requests that decoded
        # in the same earlier step share one inter-token latency, observed once per group
        gaps: dict[tuple[float, str, int], int] = {}
        rows = zip(outputs.request_ids, itertools.repeat(1), itertools.repeat(False))
        ended = ((out.request_id, len(out.new_token_ids), out.finished) for out in outputs.outputs)
        for rid, n, finished in itertools.chain(rows, ended):
            if n:
                seen = last_token.get(rid)
                if seen is not None:
                    key = (seen[0], seen[1], n)
                    gaps[key] = gaps.get(key, 0) + 1
                    seen[0] = now
                    produced += n
                elif (request := core.requests.get(rid) or core.recently_ended.get(rid)):
                    tenant = request.tenant if core.config.is_configured(request.tenant) else ""
                    self._observe("ttft", now - (request.arrival_time or now), tenant)
                    last_token[rid] = [now, tenant]
                    produced += n
            if finished:
                last_token.pop(rid, None)
        for (previous, tenant, n), count in gaps.items():
            self._observe("itl", (now - previous) / n, tenant, count)
        if produced:
            self.output_tokens += produced
            self.tokens.append((now, produced))

    def step(self, plan: StepPlan, seconds: float) -> None:
        """One executed iteration: its duration, prefill chunk sizes and decode batch size."""
        if not self.histograms:
            return
        self._count("iteration", seconds, "")
        decodes = 0  # counted here rather than by `plan.decode_tokens`: one pass, not two
        for seq in plan.seqs:
            if len(seq.token_ids) == 1 and seq.num_generated > 0:
                decodes += 1
            else:
                self._count("prefill_chunk", float(len(seq.token_ids)), "")
        self._count("decode_batch", float(decodes), "")

    def _observe(self, kind: str, seconds: float, tenant: str, count: int = 1) -> None:
        """`count` samples of `seconds`."""
        samples = self.ttft if kind == "ttft" else self.itl
        if count == 1:
            samples.append(seconds)
        else:
            samples.extend(itertools.repeat(seconds, min(count, samples.maxlen or count)))
        if self.histograms and kind in HISTOGRAM_BOUNDS:
            self._count(kind, seconds, tenant, count)

    def _count(self, kind: str, value: float, tenant: str, count: int = 1) -> None:
        buckets = self.buckets.get((kind, tenant))
        if buckets is None:
            buckets = self.buckets[kind, tenant] = Buckets(HISTOGRAM_BOUNDS[kind])
        buckets.add(value, count)

    def summary(self, now: float, window: float = 5.0) -> dict:
        recent = sum(n for t, n in self.tokens if now - t <= window)
        return {"ttft": _percentiles(self.ttft), "itl": _percentiles(self.itl),
                "tokens_per_second": recent / window, "output_tokens": self.output_tokens}


def _percentiles(samples) -> dict[str, float]:
    ordered = sorted(samples)
    if not ordered:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0}
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99)}
