"""Latency bookkeeping of the scheduler actor: time to first token, inter-token latency,
iteration times, for `sluice status`, the console and the metrics histograms."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from sluice.actors.scheduler.scheduler import Scheduler
from sluice.actors.scheduler.plan import RequestOutput, StepPlan


class LatencyLog:
    """Time to first token, inter-token latency and output tokens, from the outputs emitted.

    Keeps the latest samples for percentiles; `observers` get each sample as it happens
    (`(kind, value, tenant)`, kind `ttft`, `itl`, `iteration`, `decode_batch` or
    `prefill_chunk`), which is how metrics histograms fill. The tenant is "" for a tenant no
    config or operator created, so label sets stay bounded whatever names clients invent.
    """

    def __init__(self, keep: int = 2048):
        self.ttft: deque[float] = deque(maxlen=keep)
        self.itl: deque[float] = deque(maxlen=keep)
        self.tokens: deque[tuple[float, int]] = deque(maxlen=keep)  # (time, tokens)
        self.output_tokens = 0
        self.last_token: dict[str, float] = {}
        self.observers: list[Callable[[str, float, str], None]] = []

    def record(self, core: Scheduler, outputs: list[RequestOutput]) -> None:
        now = core.clock()
        for out in outputs:
            n = len(out.new_token_ids)
            request = core.requests.get(out.request_id) or core.recently_ended.get(out.request_id)
            if n and request is not None:
                self.output_tokens += n
                self.tokens.append((now, n))
                previous = self.last_token.get(out.request_id)
                tenant = request.tenant if core.config.is_configured(request.tenant) else ""
                if previous is None:
                    self._observe("ttft", now - (request.arrival_time or now), tenant)
                else:
                    self._observe("itl", (now - previous) / n, tenant)
                self.last_token[out.request_id] = now
            if out.finished:
                self.last_token.pop(out.request_id, None)

    def step(self, plan: StepPlan, seconds: float) -> None:
        """One executed iteration: its duration, prefill chunk sizes and decode batch size."""
        for observer in self.observers:
            observer("iteration", seconds, "")
            observer("decode_batch", float(plan.decode_tokens), "")
            for seq in plan.seqs:
                if not (len(seq.token_ids) == 1 and seq.num_generated > 0):  # not a decode
                    observer("prefill_chunk", float(len(seq.token_ids)), "")

    def _observe(self, kind: str, seconds: float, tenant: str) -> None:
        (self.ttft if kind == "ttft" else self.itl).append(seconds)
        for observer in self.observers:
            observer(kind, seconds, tenant)

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
