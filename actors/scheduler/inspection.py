"""Looking at the scheduler without changing it: the invariant check and the stats snapshot.

`check_invariants` is what tests call after every scenario and what `reconcile` runs in the
daemon; `stats` is what the daemon's snapshot publishes. Mixed into `Scheduler` (`core.py`).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

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
        for tenant in self.tenants.values():
            live = [r for r in self.requests.values() if r.tenant == tenant.name]
            waiting = sum(r.in_queue for r in live)
            running = sum(r.request_id in self.running for r in live)
            if (tenant.live, tenant.waiting, tenant.running) != (len(live), waiting, running):
                problems.append(
                    f"tenant {tenant.name}: counters live/waiting/running "
                    f"{tenant.live}/{tenant.waiting}/{tenant.running}, "
                    f"actual {len(live)}/{waiting}/{running}"
                )
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
            "tenants": {
                name: {
                    "weight": t.config.weight,
                    "limits": {
                        "max_running": t.config.max_running,
                        "max_queued": t.config.max_queued,
                        "max_context": t.config.max_context,
                        "max_new_tokens": t.config.max_new_tokens,
                    },
                    "queues": dict(per_tenant_state.get(name, {})),
                    "waiting": t.waiting,
                    "running": t.running,
                    "service": t.service,
                    "virtual_time": t.virtual_time,
                    "prefill_tokens": t.prefill_tokens,
                    "decode_tokens": t.decode_tokens,
                    "cached_tokens": t.cached_tokens,
                    "recomputed_tokens": t.recomputed_tokens,
                    "preemptions": t.preemptions,
                    "kv_block_seconds": t.kv_block_seconds,
                    "finished": t.finished,
                    "rejected": t.rejected,
                }
                for name, t in self.tenants.items()
            },
        }
