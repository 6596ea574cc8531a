"""Usage records: one per ended request, as an operator bills and diagnoses it.

A request's record is made where its end is last seen: by its Stream when the request's
`Finished` leaves for the client (the common case: only the Stream knows when the first token
and the end left the daemon), or by the Tokenizer for a request its Stream gave up without
waiting (the client vanished, the stream failed; see `Release.unattended`). Either way it is
built here, by `record`, from the same parts: the client's `Usage`, the points of `Timings`,
and the scheduler core's `RequestCost`.

The Usage actor takes the records (`Ended`, one message per handled message of its sender)
and, per record:
- logs the structured event "request ended" (ids, tenant, counts, timings; never text);
- appends it as one JSON line to the usage file, if one is configured, flushed at once; the
  file is opened for appending, so it survives restarts, and opened again on SIGHUP
  (`ReopenUsageLog`), so it can be rotated;
- adds it to the per-tenant totals and the request-timing histograms the metrics render.

Tenant labels are bounded as everywhere: a tenant no config or operator created is summed
under "" (rendered `(other)`). A record keeps the tenant's real name. A request the scheduler
never held (cancelled while it was tokenized) has no cost, and counts as `(other)` there.

Which requests each histogram counts (every finish reason, unless said):
- `ttft`: requests of which a token left the daemon, from receipt to that moment;
- `queue`: requests that were scheduled, from entering the wait queue to their first step;
- `prefill`: requests whose prompt was computed, from their first step to its end;
- `tpot`: requests that sent two tokens or more, per token after the first;
- `e2e`: every ended request that reached the scheduler, from receipt to its `Finished`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections import Counter

import structlog

from sluice.actors.runtime import messages as am
from sluice.actors.runtime.base import Actor, Handler, Outboxes
from sluice.actors.front.limits import Limits, clip
from sluice.actors.runtime.reports import (
    Histogram, TenantUsageTotals, UsageQuery, UsageRecord, UsageSnapshot, UsageSums,
)  # fmt: skip
from sluice.actors.scheduler.latency import LATENCY_BOUNDS, Buckets
from sluice.actors.scheduler.plan import RequestCost
from sluice.ipc import messages as m

log = structlog.get_logger("sluice.usage")

TIMING_KINDS = ("ttft", "queue", "prefill", "tpot", "e2e")


def since(mark: float, received: float) -> float:
    """A point on the monotonic clock as seconds after `received` (0.0: it never happened)."""
    return max(0.0, mark - received) if mark else 0.0


def core_points(cost: RequestCost | None, received: float) -> dict[str, float]:
    """The points the scheduler core saw, as `Timings` fields."""
    if cost is None:
        return {}
    return {"queued": since(cost.queued, received), "scheduled": since(cost.scheduled, received),
            "prefill_done": since(cost.prefill_done, received)}


def complete(timings: m.Timings, *, first_token: float, finished: float,
             completion_tokens: int) -> m.Timings:
    """`timings` with the delivery points (seconds after receipt) and the derived spans."""
    t = dataclasses.replace(timings, first_token=first_token, finished=finished)
    queue = t.scheduled - t.queued if t.scheduled and t.queued else 0.0
    prefill = t.prefill_done - t.scheduled if t.prefill_done and t.scheduled else 0.0
    tpot = 0.0
    if first_token and finished and completion_tokens > 1:
        tpot = (finished - first_token) / (completion_tokens - 1)
    return dataclasses.replace(t, queue=max(0.0, queue), prefill=max(0.0, prefill),
                               ttft=first_token, tpot=max(0.0, tpot), e2e=finished)


def record(*, usage_id: str, client_id: str, tenant: str, reason: m.FinishReason,
           usage: m.Usage, timings: m.Timings, cost: RequestCost | None, start: float,
           end: float, limits: Limits) -> UsageRecord:
    """The usage record of an ended request, its `timings` complete."""
    sums = UsageSums(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens,
                     usage.recomputed_tokens)
    if cost is not None:
        sums = dataclasses.replace(sums, preemptions=cost.preemptions,
                                   kv_block_seconds=cost.kv_block_seconds,
                                   compute_seconds=cost.compute_seconds)
    return UsageRecord(
        usage_id, clip(client_id, limits), cost.tenant if cost is not None else tenant,
        cost.configured if cost is not None else False, start, end, reason.name.lower(), sums,
        timings)


def as_json(rec: UsageRecord) -> dict:
    """A record as its usage-file line: wall-clock times in ISO 8601 UTC."""
    body = dataclasses.asdict(rec)
    del body["configured"]
    body.update(body.pop("sums"))  # the summed quantities stand at the top, each by name
    body["start"], body["end"] = _utc(rec.start), _utc(rec.end)
    return {"event": "usage", **body}


def _utc(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class _Totals:
    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self.sums = UsageSums()

    def add(self, rec: UsageRecord) -> None:
        self.requests[rec.finish_reason] += 1
        self.sums = self.sums.plus(rec.sums)

    def report(self, label: str) -> TenantUsageTotals:
        return TenantUsageTotals(label, tuple(sorted(self.requests.items())), self.sums)


class UsageLog(Actor):
    """The usage file, the "request ended" log line, and the totals behind the metrics."""

    name = "usage"

    def __init__(self, path: str | None = None, *, limits: Limits = Limits()):
        super().__init__()
        self.path = path
        self.limits = limits
        self.file = None
        self.askers = Outboxes()

    def reset(self) -> None:
        self.totals: dict[str, _Totals] = {}  # metrics label -> sums (restart: from zero)
        self.rejected: Counter[str] = Counter()
        self.histograms: dict[tuple[str, str], Buckets] = {}
        self.records = 0
        self._open()

    def teardown(self) -> None:
        self._close()

    def close(self) -> None:
        super().close()
        self.askers.close()

    def handlers(self) -> dict[type, Handler]:
        return {am.Ended: self.on_ended, am.ReopenUsageLog: self.on_reopen, am.Ask: self.on_ask}

    async def on_ended(self, msg: am.Ended) -> None:
        for code in msg.rejected:
            self.rejected[code.name.lower()] += 1
        for rec in msg.records:
            self.records += 1
            label = rec.tenant if rec.configured else ""
            totals = self.totals.get(label)
            if totals is None:  # not setdefault: that built a fresh _Totals per record
                totals = self.totals[label] = _Totals()
            totals.add(rec)
            self._observe(rec, label)
            log.info("request ended", request_id=rec.request_id,
                     client_request_id=rec.client_request_id,
                     tenant=clip(rec.tenant, self.limits), reason=rec.finish_reason,
                     **vars(rec.sums), ttft=rec.timings.ttft,
                     queue=rec.timings.queue, prefill=rec.timings.prefill,
                     tpot=rec.timings.tpot, e2e=rec.timings.e2e)
            if self.file is not None:
                self._write(rec)

    def _observe(self, rec: UsageRecord, label: str) -> None:
        t = rec.timings
        values = {"ttft": t.ttft if t.first_token else None,
                  "queue": t.queue if t.scheduled else None,
                  "prefill": t.prefill if t.prefill_done and t.scheduled else None,
                  "tpot": t.tpot if rec.sums.completion_tokens > 1 and t.first_token else None,
                  "e2e": t.e2e if t.queued else None}
        for kind, value in values.items():
            if value is not None:
                buckets = self.histograms.get((kind, label))
                if buckets is None:
                    buckets = self.histograms[kind, label] = Buckets(LATENCY_BOUNDS)
                buckets.add(value)

    def _write(self, rec: UsageRecord) -> None:
        try:
            self.file.write(json.dumps(as_json(rec), separators=(",", ":")) + "\n")
            self.file.flush()
        except OSError as exc:  # a full disk must not end the daemon: the log line stays
            log.error("usage file write failed", path=self.path, error=str(exc))

    async def on_reopen(self, msg: am.ReopenUsageLog) -> None:
        self._close()
        self._open()
        log.info("usage file reopened", path=self.path)

    async def on_ask(self, msg: am.Ask) -> None:
        if isinstance(msg.query, UsageQuery):
            self.askers.put(msg.reply_to, am.Reply(msg.token, self.snapshot()))

    def snapshot(self) -> UsageSnapshot:
        return UsageSnapshot(
            tuple(totals.report(label) for label, totals in sorted(self.totals.items())),
            tuple(sorted(self.rejected.items())),
            tuple(Histogram(kind, tenant, b.bounds, tuple(b.counts), b.total)
                  for (kind, tenant), b in sorted(self.histograms.items())),
            self.records)

    def _open(self) -> None:
        if self.path is None:
            return
        try:
            self.file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (kept open)
        except OSError as exc:
            self.file = None
            log.error("usage file cannot be opened; records go to the log only",
                      path=self.path, error=str(exc))

    def _close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
