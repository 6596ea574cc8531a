"""Looking at the scheduler without changing it: the invariant check and the stats snapshot.

`check_invariants` is what tests call after every scenario and what `reconcile` runs in the
daemon; `stats` is what the daemon's snapshot publishes. Mixed into `Scheduler` (`core.py`).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from sluice.actors.scheduler.config import DEFAULT_TENANT
from sluice.actors.scheduler.policy import TenantUsage
from sluice.actors.scheduler.request import RequestState

if TYPE_CHECKING:
    from sluice.actors.scheduler.core import Scheduler

_QUEUED = (RequestState.WAITING, RequestState.PREEMPTED)
_HOLDING = (RequestState.PREFILLING, RequestState.DECODING)


class InspectionMixin:
    def check_invariants(self: Scheduler) -> None:
        """Raise AssertionError describing every broken rule; call between steps."""
        bm = self.block_manager
        bm.check_consistency()
        problems: list[str] = []
        owners: Counter[int] = Counter()
        queued = 0
        for rid, request in self.requests.items():
            state = request.state
            blocks = request.block_ids
            if len(set(blocks)) != len(blocks):
                problems.append(f"{rid} lists a block twice: {blocks}")
            owners.update(blocks)
            expected = bm.blocks_for(request.num_computed_tokens)
            if len(blocks) != expected:
                problems.append(
                    f"{rid} ({state.value}) holds {len(blocks)} blocks for "
                    f"{request.num_computed_tokens} computed tokens, expected {expected}"
                )
            places = [
                name
                for name, here in (
                    ("waiting", request.in_queue),
                    ("running", rid in self.running),
                    ("paused", rid in self.paused),
                )
                if here
            ]
            if len(places) != 1:
                problems.append(f"{rid} ({state.value}) is in {places or 'no queue'}")
            expected_place = (
                "waiting"
                if state in _QUEUED
                else "running"
                if state in _HOLDING
                else "paused"
                if state is RequestState.PAUSED
                else "none"
            )
            if places and places[0] != expected_place:
                problems.append(f"{rid} is {state.value} but sits in {places[0]}")
            if state in _QUEUED and blocks:
                problems.append(f"{rid} waits in the queue while holding {len(blocks)} blocks")
            if (rid in self.prefilling) != (state is RequestState.PREFILLING):
                problems.append(f"{rid} ({state.value}) prefilling table mismatch")
            queued += request.in_queue
        for table_name in ("running", "paused", "prefilling"):
            for rid in getattr(self, table_name):
                if rid not in self.requests:
                    problems.append(f"{rid} is in {table_name} but not live")
        if queued != len(self.waiting):
            problems.append(f"queue length {len(self.waiting)} but {queued} requests queued")
        for block, count in owners.items():
            if bm.ref_count(block) != count:
                problems.append(
                    f"block {block} has {bm.ref_count(block)} references but {count} owners"
                )
        if sum(owners.values()) != sum(bm.ref_count(b) for b in range(bm.num_total_blocks)):
            orphans = [b for b in range(bm.num_total_blocks) if bm.ref_count(b) and b not in owners]
            problems.append(f"referenced blocks owned by no live request: {orphans[:8]}")
        actual: dict[str, list[int]] = {}
        for request in self.requests.values():
            counts = actual.setdefault(request.tenant, [0, 0, 0])
            counts[0] += 1
            counts[1] += request.in_queue
            counts[2] += request.request_id in self.running
        for name in set(actual) | set(self.tenants):
            tenant = self.tenants.get(name)
            counted = [tenant.live, tenant.waiting, tenant.running] if tenant else [0, 0, 0]
            if counted != actual.get(name, [0, 0, 0]) or (tenant and not tenant.live):
                problems.append(
                    f"tenant {name}: counters live/waiting/running {counted}, "
                    f"actual {actual.get(name, [0, 0, 0])} (an idle tenant keeps no state)"
                )
        stale = self.waiting.tenants - {n for n, c in actual.items() if c[1]}
        if stale:
            problems.append(f"wait queue keeps heaps of tenants with nothing queued: {stale}")
        if problems:
            raise AssertionError("scheduler inconsistent: " + "; ".join(problems))

    def stats(self: Scheduler) -> dict[str, Any]:
        """Queue lengths per state and tenant, KV numbers, preemptions and per-tenant service."""
        bm = self.block_manager
        by_state: Counter[str] = Counter(r.state.value for r in self.requests.values())
        per_tenant_state: dict[str, Counter[str]] = {}
        for request in self.requests.values():
            per_tenant_state.setdefault(request.tenant, Counter())[request.state.value] += 1
        cfg = self.config
        shown = {DEFAULT_TENANT, *cfg.tenants, *self.tenants}
        return {
            "step": self._step_id,
            "queues": {
                state.value: by_state.get(state.value, 0)
                for state in RequestState
                if not state.is_ended
            },
            "kv": {
                "total_blocks": bm.num_total_blocks,
                "free_blocks": bm.num_free_blocks,
                "cached_blocks": bm.num_cached_blocks,
                "used_blocks": bm.num_used_blocks,
                "usage": bm.usage,
                "high_watermark": cfg.kv_high_watermark,
                "low_watermark": cfg.kv_low_watermark,
                "admission_open": self._admission_open,
                "block_size": bm.block_size,
                "prefix_cache_hit_ratio": bm.cache_hits / bm.cache_queries
                if bm.cache_queries
                else 0.0,
            },
            "last_step": dict(self.last_step),
            "preemptions": self.num_preemptions,
            "rejected": self.num_rejected,
            "ended": dict(self.ended_by_reason),
            "policy": cfg.policy,
            "tenants": {name: self._tenant_stats(name, per_tenant_state) for name in shown},
            # client-named tenants (open_tenants) that are idle, summed: one entry however
            # many names clients invented, so snapshots and metric labels stay bounded
            "other_tenants": _usage_dict(self.other_usage),
        }

    def _tenant_stats(
        self: Scheduler, name: str, per_tenant_state: dict[str, Counter[str]]
    ) -> dict[str, Any]:
        limits = self.config.tenant(name)
        state = self.tenants.get(name)
        return {
            "weight": limits.weight,
            "limits": {
                "max_running": limits.max_running,
                "max_queued": self.config.max_queued_of(name),
                "max_context": limits.max_context,
                "max_new_tokens": limits.max_new_tokens,
            },
            # set up by the config or an operator (not only named by a client)
            "configured": self.config.is_configured(name),
            "queues": dict(per_tenant_state.get(name, {})),
            "waiting": state.waiting if state else 0,
            "running": state.running if state else 0,
            "virtual_time": state.virtual_time if state else 0.0,
            **_usage_dict(self.tenant_usage(name)),
        }


def _usage_dict(usage: TenantUsage) -> dict[str, Any]:
    return {name: getattr(usage, name) for name in TenantUsage.__slots__}
