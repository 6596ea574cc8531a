"""Prometheus metrics and `/health` over HTTP, served from the daemon's own event loop.

Everything comes from two snapshots asked for by message when scraped. The scheduler's
(`MetricsSnapshot`): the gauges and totals, so `sluice_kv_blocks` equals what a snapshot
taken at the same moment says, and the histograms it keeps (inter-token latency, iteration
time, prefill chunk and decode batch sizes) as typed bucket counts. The Usage actor's
(`UsageSnapshot`): what the usage records sum to per tenant (requests by finish reason,
tokens, preemptions, KV block-seconds, compute seconds), rejections by code, and the request
timings (time to first token as it left the daemon, queue, prefill, time per output token,
end to end; `actors.usage` says which requests each counts). A scrape whose Usage actor does
not answer leaves those out. Nothing here reads an actor. docs/operations.md lists them.

`/health` answers 200 while serving with a ready worker, 503 while draining, while the
worker is down or `failed` (the body says which), or when the scheduler does not answer.
Nothing here binds a port unless `metrics_port` is configured. The port is served by
hypercorn's trio worker with a small ASGI app around prometheus_client's, as the HTTP
front is (`actors.http.front`).

Tenant labels are bounded: each tenant the config or an operator created has its own label;
tenants that clients merely named (`[limits] open_tenants`) share the label `(other)`, so a
flood of invented names cannot grow the label sets.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import structlog
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from prometheus_client import CollectorRegistry, generate_latest, make_asgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from sluice.actors.http.exchange import send_text, serve_lifespan, server_log
from sluice.actors.runtime.reports import Histogram, MetricsSnapshot, UsageSnapshot
from sluice.ipc import messages as m

log = structlog.get_logger("sluice.metrics")

_REQUEST_LIMIT = 8192  # bytes of request line and headers buffered before giving up
OTHER_TENANTS = "(other)"  # the label of every tenant no config or operator created


# histogram kind (as the scheduler keeps it) -> name, help, whether labelled by tenant
HISTOGRAMS = {
    "itl": ("sluice_inter_token_latency_seconds",
            "Time between generated tokens of one request", True),
    "iteration": ("sluice_scheduler_iteration_seconds",
                  "Plan sent to result applied, per iteration", False),
    "prefill_chunk": ("sluice_prefill_chunk_tokens", "Tokens per prefill chunk", False),
    "decode_batch": ("sluice_decode_batch_size", "Decoding sequences per iteration", False),
}
# the Usage actor's request timings, all labelled by tenant
TIMING_HISTOGRAMS = {
    "ttft": ("sluice_time_to_first_token_seconds",
             "Receipt to the first token leaving the daemon, per request that sent one"),
    "queue": ("sluice_request_queue_seconds", "Wait queue entry to first step, per request"),
    "prefill": ("sluice_request_prefill_seconds", "First step to prompt computed, per request"),
    "tpot": ("sluice_time_per_output_token_seconds",
             "First token to Finished sent, per later token, per request of 2+ tokens"),
    "e2e": ("sluice_e2e_request_latency_seconds",
            "Receipt to Finished sent, per request the scheduler held"),
}


class Metrics:
    """The daemon's metric registry, rendered from the latest `MetricsSnapshot`."""

    def __init__(self, snapshot: Callable[[], Awaitable[MetricsSnapshot]],
                 usage: Callable[[], Awaitable[UsageSnapshot]] | None = None):
        self.snapshot = snapshot  # asks the scheduler for a MetricsSnapshot
        self.usage = usage  # asks the Usage actor for its UsageSnapshot
        self.latest: MetricsSnapshot | None = None  # the snapshot of the scrape being answered
        self.latest_usage: UsageSnapshot | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SchedulerCollector(lambda: self.latest))
        self.registry.register(_UsageCollector(lambda: self.latest_usage))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def refresh(self) -> bool:
        """Ask for a fresh snapshot; False when the scheduler does not answer."""
        try:
            self.latest = await self.snapshot()
        except trio.TooSlowError:
            return False
        self.latest_usage = None
        if self.usage is not None:
            try:
                self.latest_usage = await self.usage()
            except trio.TooSlowError:
                log.warning("the usage actor did not answer the scrape")
        return True

    def healthy(self) -> tuple[bool, str]:
        report = self.latest.snapshot.status
        if report.state != "serving":
            return False, report.state
        if report.worker.state != "ready":
            failure = f": {report.worker.failure}" if report.worker.failure else ""
            return False, f"worker {report.worker.state}{failure}"
        return True, "serving"


def bounded_tenants(detail: m.ConsoleDetail) -> dict[str, m.TenantRow]:
    """One row per configured tenant, and the rest summed as `(other)`: a row of which only
    the totals and the running requests mean anything."""
    shown = {name: row for name, row in detail.tenants.items() if row.configured}
    folded = [row for row in detail.tenants.values() if not row.configured]
    other = _sum_totals([detail.other_tenants, *(row.totals for row in folded)])
    if folded or other != m.TenantTotals():
        shown[OTHER_TENANTS] = m.TenantRow(running=sum(row.running for row in folded),
                                           totals=other)
    return shown


def _sum_totals(totals: list[m.TenantTotals]) -> m.TenantTotals:
    return m.TenantTotals(**{f.name: sum(getattr(t, f.name) for t in totals)
                             for f in dataclasses.fields(m.TenantTotals)})


def histogram_families(histograms: tuple[Histogram, ...],
                       names: dict[str, tuple[str, str, bool]] = HISTOGRAMS,
                       ) -> Iterator[HistogramMetricFamily]:
    """Histograms as Prometheus families (cumulative buckets, `le` labels), named by kind."""
    families: dict[str, HistogramMetricFamily] = {}
    for histogram in histograms:
        name, help_text, by_tenant = names[histogram.kind]
        family = families.get(name)
        if family is None:
            family = families[name] = HistogramMetricFamily(
                name, help_text, labels=["tenant"] if by_tenant else None)
        buckets, seen = [], 0
        for bound, count in zip((*histogram.bounds, float("inf")), histogram.counts):
            seen += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), seen))
        labels = [histogram.tenant or OTHER_TENANTS] if by_tenant else []
        family.add_metric(labels, buckets, sum_value=histogram.total)
    yield from families.values()


class _SchedulerCollector:
    """Gauges, totals and histograms from the scheduler's snapshot taken at scrape time."""

    def __init__(self, snapshot: Callable[[], MetricsSnapshot | None]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        latest = self.snapshot()
        if latest is None:
            return
        yield from histogram_families(latest.histograms)
        # the scheduler always sends a detail; only a snapshot made without one has none
        report, detail = latest.snapshot.status, latest.snapshot.detail or m.ConsoleDetail()
        kv = GaugeMetricFamily("sluice_kv_blocks", "KV cache blocks by state", labels=["state"])
        for state, value in (("free", report.kv.free_blocks), ("cached", report.kv.cached_blocks),
                             ("used", report.kv.used_blocks), ("total", report.kv.total_blocks)):
            kv.add_metric([state], value)
        yield kv
        yield GaugeMetricFamily("sluice_prefix_cache_hit_ratio",
                                "Prefix cache hits per lookup since start",
                                value=detail.kv.prefix_cache_hit_ratio)
        queues = GaugeMetricFamily("sluice_live_requests", "Live requests by state",
                                   labels=["state"])
        for state, value in detail.queues.items():
            queues.add_metric([state], value)
        yield queues
        preempted = CounterMetricFamily(
            "sluice_preemptions_by_cause", "Requests preempted (KV released), by cause: memory "
            "pressure or a higher-priority arrival; rate() of it is the preemption rate",
            labels=["cause"])
        counters = report.counters
        preempted.add_metric(["memory"], counters.preemptions - counters.priority_preemptions)
        preempted.add_metric(["priority"], counters.priority_preemptions)
        yield preempted
        yield CounterMetricFamily("sluice_preemptions", "Requests preempted (KV released)",
                                  value=report.counters.preemptions)
        outcomes = CounterMetricFamily("sluice_requests", "Requests by outcome",
                                       labels=["outcome"])
        for outcome in ("accepted", "finished", "cancelled", "rejected"):
            outcomes.add_metric([outcome], getattr(report.counters, outcome))
        yield outcomes
        tenants = bounded_tenants(detail)
        per_tenant = {
            "sluice_tenant_requests": ("Ended or rejected requests per tenant", "outcome",
                                       {"finished": "finished", "rejected": "rejected"}),
            "sluice_tenant_tokens": ("Tokens computed per tenant", "kind",
                                     {"prefill": "prefill_tokens", "decode": "decode_tokens",
                                      "cached": "cached_tokens",
                                      "recomputed": "recomputed_tokens"}),
        }
        for name, (help_text, label, fields) in per_tenant.items():
            family = CounterMetricFamily(name, help_text, labels=["tenant", label])
            for tenant, row in tenants.items():
                for value_label, key in fields.items():
                    family.add_metric([tenant, value_label], getattr(row.totals, key))
            yield family
        preempted = CounterMetricFamily("sluice_tenant_preemptions", "Preemptions per tenant",
                                        labels=["tenant"])
        running = GaugeMetricFamily("sluice_tenant_running", "Running requests per tenant",
                                    labels=["tenant"])
        for tenant, row in tenants.items():
            preempted.add_metric([tenant], row.totals.preemptions)
            running.add_metric([tenant], row.running)
        yield preempted
        yield running
        yield GaugeMetricFamily("sluice_worker_up", "1 when the worker passed its health check",
                                value=1.0 if report.worker.state == "ready" else 0.0)
        yield CounterMetricFamily("sluice_worker_restarts", "Worker restarts",
                                  value=report.worker.restarts)
        yield CounterMetricFamily("sluice_worker_oom_steps",
                                  "Steps the worker ran out of memory in (each planned again)",
                                  value=report.worker.oom_steps)
        yield GaugeMetricFamily("sluice_draining", "1 while the daemon does not admit",
                                value=1.0 if report.state != "serving" else 0.0)
        yield CounterMetricFamily("sluice_drain_refusals",
                                  "Requests refused because the daemon was draining",
                                  value=report.gateway.drain_refusals)


class _UsageCollector:
    """Per-tenant usage, rejections and request timings from the Usage actor's snapshot."""

    def __init__(self, snapshot: Callable[[], UsageSnapshot | None]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        latest = self.snapshot()
        if latest is None:
            return
        yield from histogram_families(
            latest.histograms,
            {kind: (name, text, True) for kind, (name, text) in TIMING_HISTOGRAMS.items()})
        requests = CounterMetricFamily("sluice_tenant_usage_requests",
                                       "Ended requests per tenant, by finish reason",
                                       labels=["tenant", "reason"])
        tokens = CounterMetricFamily("sluice_tenant_usage_tokens",
                                     "Tokens per tenant, summed over its usage records",
                                     labels=["tenant", "kind"])
        sums = {name: CounterMetricFamily(f"sluice_tenant_usage_{name}", text, labels=["tenant"])
                for name, text in (
                    ("preemptions", "Preemptions of ended requests per tenant"),
                    ("kv_block_seconds", "KV blocks held times seconds, per tenant"),
                    ("compute_seconds", "Forward time apportioned by tokens, per tenant"))}
        reasons: dict[str, int] = {}
        for row in latest.tenants:
            tenant = row.tenant or OTHER_TENANTS
            for reason, count in row.requests:
                requests.add_metric([tenant, reason], count)
                reasons[reason] = reasons.get(reason, 0) + count
            for kind in ("prompt", "completion", "cached", "recomputed"):
                tokens.add_metric([tenant, kind], getattr(row.sums, f"{kind}_tokens"))
            for name, family in sums.items():
                family.add_metric([tenant], getattr(row.sums, name))
        yield requests
        yield tokens
        yield from sums.values()
        ended = CounterMetricFamily("sluice_requests_ended", "Ended requests by finish reason",
                                    labels=["reason"])
        for reason, count in sorted(reasons.items()):
            ended.add_metric([reason], count)
        yield ended
        rejected = CounterMetricFamily("sluice_requests_rejected",
                                       "Rejections sent to clients, by code", labels=["code"])
        for code, count in latest.rejected:
            rejected.add_metric([code], count)
        yield rejected


async def serve_metrics(metrics: Metrics, host: str, port: int, *,
                        task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Serve `/metrics` and `/health` on host:port with hypercorn (the HTTP front's server);
    `started()` gets the bound port."""
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.h11_max_incomplete_size = _REQUEST_LIMIT
    config.keep_alive_timeout = 10.0  # a scrape may wait that long for the scheduler
    config.include_server_header = False
    config.accesslog = None
    config.errorlog = server_log("sluice.metrics.server")
    config.graceful_timeout = 1.0
    prometheus = make_asgi_app(metrics.registry)

    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        path = scope["path"]
        if scope["method"] not in ("GET", "HEAD"):
            await send_text(send, 405, "only GET")
        elif path not in ("/metrics", "/health"):
            await send_text(send, 404, "not found: try /metrics or /health")
        elif not await metrics.refresh():
            await send_text(send, 503, "the scheduler does not answer")
        elif path == "/metrics":
            await prometheus(scope, receive, send)
        else:
            ok, why = metrics.healthy()
            await send_text(send, 200 if ok else 503, why)

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(functools.partial(serve, app, config,
                                                      shutdown_trigger=trio.sleep_forever))
        bound = int(binds[0].rsplit(":", 1)[1])
        log.info("metrics listening", host=host, port=bound)
        task_status.started(bound)
