"""Run a scenario through the real scheduler core with a simulated executor and a cost model.

No model and no randomness: every sampled token is a fixed non-stop id, each request stops at
its `output` length, and a round takes the cost model's seconds for the tokens it planned.
The result is the per-round plan, per-request timings, per-tenant service and summary metrics
(the `sluice simulate --json` object). Parsing of scenario files is in `scenario.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.actors.scheduler.scheduler import Scheduler
from sluice.actors.scheduler.plan import StepResult
from sluice.actors.scheduler.request import Request
from sluice.actors.scheduler.scenario import Scenario, SimRequest, percentile
from sluice.ipc.vocabulary import FinishReason, QuotaError, SamplingParams

_TOKEN = 1  # what the simulated model always samples; never a stop token
# simulated seconds between looks while only token buckets hold requests back; a bucket
# holds a minute's tokens, so past a minute of that nothing will ever run
RATE_WAIT_STEP = 0.25
RATE_WAIT_LIMIT = 61.0


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class RequestTrace:
    tenant: str
    arrival: float
    token_times: list[float] = field(default_factory=list)
    first_scheduled: float | None = None
    finish_time: float | None = None
    finish_reason: FinishReason | None = None
    preemptions: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    rejected: str | None = None  # the reject code, for a request refused at arrival (a rate)
    retry_after: float = 0.0


@dataclass
class SimulationResult:
    rounds: list[dict[str, Any]]
    requests: dict[str, RequestTrace]
    scheduler: Scheduler
    end_time: float

    def to_dict(self) -> dict[str, Any]:
        config = self.scheduler.config
        tenants = {}
        for name in sorted({t.tenant for t in self.requests.values()}):
            t = self.scheduler.ledger.tenant_usage(name)
            tenants[name] = {
                "weight": config.tenant(name).weight,
                "prefill_tokens": t.prefill_tokens,
                "decode_tokens": t.decode_tokens,
                "service": t.service,
                "preemptions": t.preemptions,
                "recomputed_tokens": t.recomputed_tokens,
                "cached_tokens": t.cached_tokens,
            }
        requests = {}
        ttfts, gaps = [], []
        for rid, trace in self.requests.items():
            times = trace.token_times
            request_gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
            gaps.extend(request_gaps)
            if times:
                ttfts.append(times[0] - trace.arrival)
            requests[rid] = {
                "tenant": trace.tenant,
                "arrival": trace.arrival,
                "first_token_time": times[0] if times else None,
                "finish_time": trace.finish_time,
                "finish_reason": trace.finish_reason and trace.finish_reason.name.lower(),
                "max_token_gap": max(request_gaps, default=0.0),
                "wait": None
                if trace.first_scheduled is None
                else trace.first_scheduled - trace.arrival,
                "output_tokens": len(times),
                "preemptions": trace.preemptions,
                "cached_tokens": trace.cached_tokens,
                "recomputed_tokens": trace.recomputed_tokens,
                "rejected": trace.rejected,
                "retry_after": trace.retry_after,
            }
        output_tokens = sum(len(t.token_times) for t in self.requests.values())
        normalised = [v["service"] / v["weight"] for v in tenants.values()]
        return {
            "rounds": self.rounds,
            "requests": requests,
            "tenants": tenants,
            "metrics": {
                "rounds": len(self.rounds),
                "time": self.end_time,
                "output_tokens": output_tokens,
                "throughput_tokens_per_s": output_tokens / self.end_time if self.end_time else 0.0,
                "ttft_p50": percentile(ttfts, 50),
                "ttft_p99": percentile(ttfts, 99),
                "itl_p99": percentile(gaps, 99),
                "jain_weighted_service": jain_index(normalised),
                "preemptions": self.scheduler.num_preemptions,
                "rejected": sum(t.rejected is not None for t in self.requests.values()),
            },
        }


def jain_index(values: list[float]) -> float:
    """(sum x)^2 / (n * sum x^2): 1.0 when all equal, 1/n when one takes everything."""
    if not values or not any(values):
        return 1.0
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def simulate(scenario: Scenario, *, check_invariants: bool = False) -> SimulationResult:
    """Drive the scheduler core round by round until every request ends or a limit is hit."""
    clock = SimClock()
    longest = max((r.prompt + r.output for r in scenario.requests), default=1)
    sched = Scheduler(scenario.config, max_model_len=longest + 1, clock=clock)
    cost = scenario.cost
    pending = sorted(scenario.requests, key=_arrival_key)
    cancels = sorted(
        (r for r in scenario.requests if r.cancel_round is not None or r.cancel_time is not None),
        key=lambda r: (r.cancel_round if r.cancel_round is not None else -1, r.cancel_time or 0.0),
    )
    traces: dict[str, RequestTrace] = {}
    rounds: list[dict[str, Any]] = []
    now, round_no = 0.0, 0
    stalled_since: float | None = None  # since when no plan had work (rates, timeouts)
    prefixes: dict[str, int] = {}
    while True:
        if scenario.max_rounds is not None and round_no >= scenario.max_rounds:
            break
        if scenario.max_time is not None and now >= scenario.max_time:
            break
        clock.now = now
        while pending and _due(pending[0], round_no, now):
            spec = pending.pop(0)
            arrival = spec.arrival_time if spec.arrival_time is not None else now
            trace = traces[spec.id] = RequestTrace(spec.tenant, arrival)
            try:
                sched.add_request(_make_request(spec, arrival, len(traces), prefixes))
            except QuotaError as exc:  # a tenant's limit refuses it, as the daemon would
                trace.rejected, trace.retry_after = exc.code.name.lower(), exc.retry_after
                trace.finish_time = now
        cancelled = []
        while cancels and _cancel_due(cancels[0], round_no, now):
            spec = cancels.pop(0)
            out = sched.abort(spec.id) if spec.id in traces else None
            if out is not None:
                _record_end(traces[spec.id], out, now)
                cancelled.append(spec.id)
        for out in sched.expire():  # timeouts end like cancellations, in the round they pass
            _record_end(traces[out.request_id], out, now)
            cancelled.append(out.request_id)
        if not sched.has_unfinished():
            if cancelled:  # the round consisted only of cancellations
                rounds.append(
                    {
                        "round": round_no,
                        "time": now,
                        "prefill": {},
                        "decode": [],
                        "finished": [],
                        "cancelled": cancelled,
                    }
                )
                round_no += 1
            if not pending:
                break
            nxt = pending[0]
            if nxt.arrival_time is not None:
                now = max(now, nxt.arrival_time)
            else:
                round_no = max(round_no + 1, nxt.arrival_round or 0)
            continue
        plan = sched.schedule()
        if plan.seqs or stalled_since is None:
            stalled_since = now
        if not plan.seqs:  # everyone waits: for an arrival, a cancel, a timeout or a rate
            upcoming = [r.arrival_time for r in pending[:1] if r.arrival_time is not None]
            upcoming += [r.cancel_time for r in cancels[:1] if r.cancel_time is not None]
            if sched.next_deadline() is not None:
                upcoming.append(sched.next_deadline())
            if sched.ledger.rates.buckets and now - stalled_since < RATE_WAIT_LIMIT:
                upcoming.append(now + RATE_WAIT_STEP)  # a token bucket refills meanwhile
            if not upcoming and not pending and not cancels:
                raise RuntimeError("simulation stalled: requests wait but nothing can run")
            now = max(now, min(upcoming, default=now))
            round_no += 1
            continue
        prefill: dict[str, int] = {}
        decode: list[str] = []
        for seq in plan.seqs:
            request = sched.requests[seq.request_id]
            trace = traces[seq.request_id]
            if trace.first_scheduled is None:
                trace.first_scheduled = now
            if request.last_chunk_was_decode:
                decode.append(seq.request_id)
            else:
                prefill[seq.request_id] = len(seq.token_ids)
        elapsed = cost.round_seconds(sum(prefill.values()), len(decode))
        end = now + elapsed
        clock.now = end
        result = StepResult(
            plan.step_id,
            {s.request_id: _TOKEN for s in plan.seqs if s.sample},
            forward_seconds=elapsed,
        )
        finished = []
        for out in sched.update(plan, result):
            trace = traces[out.request_id]
            trace.token_times.extend([end] * len(out.new_token_ids))
            if out.finished:
                _record_end(trace, out, end)
                finished.append(out.request_id)
        if check_invariants:
            sched.check_invariants()
        entry: dict[str, Any] = {
            "round": round_no,
            "time": now,
            "prefill": prefill,
            "decode": decode,
            "finished": finished,
        }
        if cancelled:
            entry["cancelled"] = cancelled
        rounds.append(entry)
        now = end
        round_no += 1
    for rid, trace in traces.items():
        live = sched.get_request(rid)
        if live is not None and trace.finish_time is None:
            trace.preemptions = live.num_preemptions
            trace.recomputed_tokens = live.num_recomputed_tokens
            trace.cached_tokens = live.num_cached_tokens
    return SimulationResult(rounds, traces, sched, now)


def _arrival_key(spec: SimRequest) -> tuple:
    if spec.arrival_time is not None:
        return (1, spec.arrival_time, spec.id)
    return (0, spec.arrival_round, spec.id)


def _due(spec: SimRequest, round_no: int, now: float) -> bool:
    if spec.arrival_time is not None:
        return spec.arrival_time <= now
    return spec.arrival_round <= round_no


def _cancel_due(spec: SimRequest, round_no: int, now: float) -> bool:
    if spec.cancel_time is not None:
        return spec.cancel_time <= now
    return spec.cancel_round <= round_no


def _make_request(
    spec: SimRequest, arrival: float, serial: int, prefixes: dict[str, int]
) -> Request:
    base = serial * 1_000_000  # distinct tokens per request: no accidental prefix sharing
    tokens = list(range(base, base + spec.prompt))
    if spec.prefix is not None and spec.prefix_len:
        shared_base = prefixes.setdefault(spec.prefix, (len(prefixes) + 1) * 1_000_000_000)
        n = min(spec.prefix_len, spec.prompt)
        tokens[:n] = range(shared_base, shared_base + n)
    sampling = SamplingParams(max_tokens=spec.output, temperature=0.0, ignore_eos=True)
    return Request(spec.id, tokens, sampling, tenant=spec.tenant, priority=spec.priority,
                   arrival_time=arrival, timeout=spec.timeout)


def _record_end(trace: RequestTrace, out, when: float) -> None:
    trace.finish_time = when
    trace.finish_reason = out.finish_reason
    trace.preemptions = out.preemptions
    trace.cached_tokens = out.cached_tokens
    trace.recomputed_tokens = out.recomputed_tokens
