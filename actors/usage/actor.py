"""The Usage actor: takes the usage records of ended requests (`Ended`) and, per record, logs
"request ended" (ids, tenant, counts, timings; never text), appends it as one JSON line to the
usage file if one is configured (reopened on SIGHUP, so it can be rotated), and adds it to the
per-tenant totals and request-timing histograms the metrics render.

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
from sluice.actors.usage.records import as_json

log = structlog.get_logger("sluice.usage")


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
