"""Operator commands, reconcile and status of the scheduler, as plain functions over its core.

Each takes the scheduler core (and what the command names) and returns the reply, with the
outputs of any request it ended; the Scheduler actor (`actor.py`) calls them,
sends the outputs on like any others and answers the asker. Nothing here awaits, so tests
drive them without trio. Reconcile and the consistency check of `status --check` must run
between two steps (a step in flight holds blocks for tokens it has not computed yet, which is
no discrepancy): the actor decides when; these functions only look and fix.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

import structlog

from sluice.actors.scheduler import ConfigError, RequestState, Scheduler, TenantConfig
from sluice.actors.scheduler.invariants import block_owners
from sluice.actors.scheduler.plan import RequestOutput
from sluice.ipc import messages as m

log = structlog.get_logger("sluice.scheduler")

Outcome = tuple[m.CommandReply, list[RequestOutput]]  # the reply, and the requests it ended


def cancel(core: Scheduler, request_id: str) -> Outcome:
    out = core.abort(request_id, m.FinishReason.CANCELLED)
    if out is None:
        return m.CommandReply("cancel", False, f"no live request {request_id}"), []
    return m.CommandReply("cancel", True, f"cancelled {request_id}"), [out]


def release_all(core: Scheduler) -> Outcome:
    """The drain deadline passed: every request still live is cancelled."""
    rids = tuple(core.requests)
    outputs = [out for rid in rids if (out := core.abort(rid)) is not None]
    reply = m.CommandReply("drain", True, f"cancelled {len(rids)} requests past the deadline")
    return reply, outputs


def set_tenant(core: Scheduler,
               command: m.TenantSet) -> tuple[m.CommandReply, list[RequestOutput]]:
    """Change the fields the command sets, on top of the tenant's current (or reset) config;
    the outputs of the queued requests the new rates can never take, which end."""
    if command.reset:
        current = TenantConfig()
    elif command.name in core.ledger.tenants:
        current = core.ledger.tenants[command.name].config
    else:
        current = core.config.tenant(command.name)
    changes = {f.name: getattr(command, f.name) for f in dataclasses.fields(current)
               if getattr(command, f.name) is not None}
    try:
        tenant = dataclasses.replace(current, **changes)
    except ConfigError as exc:
        return m.CommandReply("tenant", False, f"tenant {command.name}: {exc}"), []
    outputs = core.configure_tenant(command.name, tenant)
    return m.CommandReply("tenant", True, f"tenant {command.name}: {tenant}"), outputs


def leak_block(core: Scheduler) -> m.CommandReply:
    """A fault for tests: one block referenced by nobody, for reconcile to find."""
    block = core.kv_cache.allocate(1)[0]
    return m.CommandReply("fault", True, f"leaked block {block}")


def unowned_references(core: Scheduler) -> list[tuple[int, int]]:
    """(block, references) for every block referenced more often than requests own it."""
    return core.kv_cache.unowned_references(block_owners(core.requests.values()))


def reconcile(
    core: Scheduler, connections: frozenset[bytes]
) -> tuple[list[str], list[RequestOutput]]:
    """Fix what the tables disagree on and say what it was; run it between steps.

    A request whose connection (the hex prefix of its id) is not live is released; a block
    referenced more often than requests own it gets the extra references freed.
    """
    findings: list[str] = []
    outputs = []
    for rid in [rid for rid in core.requests if _connection_gone(rid, connections)]:
        request = core.requests[rid]
        findings.append(f"request {rid} ({request.state.value}, "
                        f"{len(request.held_block_ids)} blocks) has no live connection: released")
        out = core.abort(rid, m.FinishReason.CANCELLED)
        if out is not None:
            outputs.append(out)
    for block, extra in unowned_references(core):
        findings.append(f"block {block} had {extra} reference(s) owned by no request: freed")
        core.kv_cache.free([block] * extra)
    try:
        core.check_invariants()
    except AssertionError as exc:
        findings.append(f"still inconsistent: {exc}")
    if findings:
        log.warning("reconcile fixed discrepancies", count=len(findings))
    return findings, outputs


def reconcile_reply(findings: list[str]) -> m.CommandReply:
    summary = (f"found and fixed {len(findings)} discrepancy(ies)" if findings
               else "consistent: nothing to fix")
    return m.CommandReply("reconcile", True, summary, tuple(findings))


def _connection_gone(request_id: str, connections: frozenset[bytes]) -> bool:
    connection, sep, _ = request_id.partition("/")
    return bool(sep) and bytes.fromhex(connection) not in connections


def status_report(core: Scheduler, *, worker: m.WorkerStatus, counters: Mapping[str, int],
                  draining: bool, check: bool = False) -> m.StatusReport:
    """What `sluice status` shows; `check` runs the invariant check too."""
    kv = core.kv_cache
    errors: tuple[str, ...] = ()
    if check:
        try:
            core.check_invariants()
        except AssertionError as exc:
            errors = (str(exc),)
    waiting = len(core.requests) - len(core.running) - len(core.paused)
    return m.StatusReport(
        state="draining" if draining else "serving",
        worker=worker,
        kv=m.KVStatus(kv.num_total_blocks, kv.num_free_blocks, kv.num_used_blocks,
                      kv.num_cached_blocks),
        requests=m.RequestCounts(waiting, len(core.running), len(core.paused)),
        counters=m.Counters(preemptions=core.num_preemptions,
                            priority_preemptions=core.num_priority_preemptions, **counters),
        invariant_errors=errors,
    )


def console_detail(core: Scheduler, *, latency: m.LatencySummary,
                   max_requests: int = 200) -> m.ConsoleDetail:
    """What the console shows beyond the status report, as the core's `stats()` says it."""
    now = core.clock()
    stats = core.stats()
    kv = stats["kv"]
    return m.ConsoleDetail(
        step=stats["step"],
        policy=stats["policy"],
        queues=stats["queues"],
        kv=m.KVDetail(kv["usage"], kv["high_watermark"], kv["low_watermark"],
                      kv["admission_open"], kv["block_size"], kv["prefix_cache_hit_ratio"]),
        last_step=m.PlanComposition(**stats["last_step"]),  # empty before the first step
        rejected=stats["rejected"],
        ended=stats["ended"],
        tenants={name: _tenant_row(values) for name, values in stats["tenants"].items()},
        other_tenants=m.TenantTotals(**stats["other_tenants"]),
        requests=tuple(
            m.RequestRow(r.request_id, r.tenant, r.state.value, now - (r.arrival_time or now),
                         r.num_prompt_tokens, r.num_output_tokens, len(r.held_block_ids),
                         r.state is RequestState.PAUSED)
            for r in itertools.islice(core.requests.values(), max_requests)),
        latency=latency,
    )


def _tenant_row(values: Mapping[str, Any]) -> m.TenantRow:
    """One tenant as `TenantLedger.stats()` says it."""
    totals = {f.name: values[f.name] for f in dataclasses.fields(m.TenantTotals)}
    return m.TenantRow(weight=values["weight"], limits=values["limits"],
                       configured=values["configured"], queues=values["queues"],
                       waiting=values["waiting"], running=values["running"],
                       virtual_time=values["virtual_time"], totals=m.TenantTotals(**totals),
                       input_tokens_available=values["input_tokens_available"],
                       output_tokens_available=values["output_tokens_available"])


def latency_summary(summary: Mapping[str, Any]) -> m.LatencySummary:
    """`LatencyLog.summary()` as the console's record."""
    return m.LatencySummary(m.Percentiles(**summary["ttft"]), m.Percentiles(**summary["itl"]),
                            summary["tokens_per_second"], summary["output_tokens"])
