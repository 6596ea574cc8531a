"""Prometheus metrics and `/health` over HTTP, served from the daemon's own event loop.

Everything comes from one snapshot the scheduler is asked for (by message, a
`MetricsSnapshot`) when scraped: the gauges and totals, so `sluice_kv_blocks` equals what a
snapshot taken at the same moment says, and the histograms the scheduler keeps (time to
first token, inter-token latency, iteration time, prefill chunk and decode batch sizes) as
typed bucket counts. Nothing here reads an actor. Names follow DESIGN §10.

`/health` answers 200 while serving with a ready worker, 503 while draining, while the
worker is down or `failed` (the body says which), or when the scheduler does not answer.
Nothing here binds a port unless `metrics_port` is configured. The port is served by
hypercorn's trio worker with a small ASGI app around prometheus_client's, as the HTTP
front is (`actors.http`).

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

from sluice.actors.http_exchange import send_text, serve_lifespan, server_log
from sluice.actors.reports import Histogram, MetricsSnapshot
from sluice.ipc import messages as m

log = structlog.get_logger("sluice.metrics")

_REQUEST_LIMIT = 8192  # bytes of request line and headers buffered before giving up
OTHER_TENANTS = "(other)"  # the label of every tenant no config or operator created


# histogram kind (as the scheduler keeps it) -> name, help, whether labelled by tenant
HISTOGRAMS = {
    "ttft": ("sluice_time_to_first_token_seconds", "Arrival to first generated token", True),
    "itl": ("sluice_inter_token_latency_seconds",
            "Time between generated tokens of one request", True),
    "iteration": ("sluice_scheduler_iteration_seconds",
                  "Plan sent to result applied, per iteration", False),
    "prefill_chunk": ("sluice_prefill_chunk_tokens", "Tokens per prefill chunk", False),
    "decode_batch": ("sluice_decode_batch_size", "Decoding sequences per iteration", False),
}


class Metrics:
    """The daemon's metric registry, rendered from the latest `MetricsSnapshot`."""

    def __init__(self, snapshot: Callable[[], Awaitable[MetricsSnapshot]]):
        self.snapshot = snapshot  # asks the scheduler for a MetricsSnapshot
        self.latest: MetricsSnapshot | None = None  # the snapshot of the scrape being answered
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SchedulerCollector(lambda: self.latest))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def refresh(self) -> bool:
        """Ask for a fresh snapshot; False when the scheduler does not answer."""
        try:
            self.latest = await self.snapshot()
        except trio.TooSlowError:
            return False
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


def histogram_families(histograms: tuple[Histogram, ...]) -> Iterator[HistogramMetricFamily]:
    """The scheduler's histograms as Prometheus families (cumulative buckets, `le` labels)."""
    families: dict[str, HistogramMetricFamily] = {}
    for histogram in histograms:
        name, help_text, by_tenant = HISTOGRAMS[histogram.kind]
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
        yield GaugeMetricFamily("sluice_draining", "1 while the daemon does not admit",
                                value=1.0 if report.state != "serving" else 0.0)


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
