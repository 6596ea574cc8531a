"""State changes of the scheduler core that happen outside planning: end, preempt, pause, requeue.

Every end state releases every block the request holds in the same call; that rule lives in
`_end` and nowhere else. Mixed into `Scheduler` (see `core.py`), which owns the tables used here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from sluice.actors.scheduler.config import TenantConfig
from sluice.actors.scheduler.plan import RequestOutput, StepPlan
from sluice.actors.scheduler.policy import TenantState, TenantUsage
from sluice.actors.scheduler.request import FAILED_REASONS, Request, RequestState

if TYPE_CHECKING:
    from sluice.actors.scheduler.core import Scheduler

WAITING, PREFILLING, DECODING = RequestState.WAITING, RequestState.PREFILLING, RequestState.DECODING
PAUSED, PREEMPTED = RequestState.PAUSED, RequestState.PREEMPTED
_HOLDING = (PREFILLING, DECODING)
_RECENT_LIMIT = 1024


class LifecycleMixin:
    # -- public operations ------------------------------------------------------------------
    def abort(self: Scheduler, request_id: str, reason: str = "cancelled") -> RequestOutput | None:
        """End a request that did not finish by itself; None if it is unknown or already ended."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        state = RequestState.FAILED if reason in FAILED_REASONS else RequestState.CANCELLED
        return self._end(request, reason, state)

    def finish(self: Scheduler, request_id: str, reason: str = "stop") -> RequestOutput | None:
        """End a request that the engine found complete (a stop string matched)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        return self._end(request, reason, RequestState.FINISHED)

    def pause(self: Scheduler, request_id: str) -> None:
        """Stop stepping a request (its client is slow); KV it holds is kept."""
        request = self.requests.get(request_id)
        if request is None or request.state is PAUSED:
            return
        self._leave_current_place(request)
        request.resume_state = request.state
        request.state = PAUSED
        self.paused[request_id] = request

    def resume(self: Scheduler, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is None or request.state is not PAUSED:
            return
        del self.paused[request_id]
        state = request.resume_state or WAITING
        request.resume_state = None
        request.state = state
        if state in _HOLDING:
            self.running[request_id] = request
            self.tenants[request.tenant].running += 1
            if state is PREFILLING:
                self.prefilling[request_id] = request
        else:
            self._enqueue(request)

    def requeue_all(self: Scheduler) -> list[str]:
        """The KV pool is gone: everyone holding KV goes back to the queue to recompute."""
        requeued = []
        for request in [*self.running.values(), *self.paused.values()]:
            if not request.block_ids:
                continue
            requeued.append(request.request_id)
            self._drop_kv(request, free=False)
            if request.state is PAUSED:
                request.resume_state = PREEMPTED
            else:
                self._leave_current_place(request)
                request.state = PREEMPTED
                self._enqueue(request)
        self.block_manager.reset()
        self._admission_open = True
        return requeued

    def charge_lost_step(
        self: Scheduler, plan: StepPlan | None, max_losses: int
    ) -> list[RequestOutput]:
        """The worker died during `plan` (after `requeue_all`): suspect its requests.

        They are bisected in later plans (see `bisection.py`); a request that was alone in
        `max_losses` lost steps ends with "error", so it cannot hold the daemon in a restart
        loop, while the requests batched with it go on.
        """
        if plan is None:
            return []
        failed = self.bisection.step_lost(plan, self.requests, max_losses)
        return [self._end(self.requests[rid], "error", RequestState.FAILED) for rid in failed]

    def has_unfinished(self: Scheduler) -> bool:
        return bool(self.requests)

    def get_request(self: Scheduler, request_id: str) -> Request | None:
        """A live request, or one of the recently ended ones."""
        return self.requests.get(request_id) or self.recently_ended.get(request_id)

    def configure_tenant(self: Scheduler, name: str, tenant: TenantConfig) -> None:
        """Change a tenant's weight or limits at run time (operator command, config reload).

        New limits apply to later admissions; requests already queued or running keep going.
        """
        tenants = dict(self.config.tenants)
        tenants[name] = tenant
        self.config = dataclasses.replace(self.config, tenants=tenants)
        if name in self.tenants:  # an idle tenant picks its config up when it becomes active
            self.tenants[name].config = tenant

    # -- internals --------------------------------------------------------------------------
    def _tenant(self: Scheduler, name: str) -> TenantState:
        """The scheduling state of a tenant, created (as idle) if it has none."""
        tenant = self.tenants.get(name)
        if tenant is None:
            if name not in self.usage:
                self.usage[name] = TenantUsage()
            config = self.config.tenant(name)
            tenant = self.tenants[name] = TenantState(name, config, TenantUsage())
        return tenant

    def tenant_usage(self: Scheduler, name: str) -> TenantUsage:
        """All a tenant has used so far: its record plus what it used since it became active."""
        total = TenantUsage()
        if name in self.usage:
            total.add(self.usage[name])
        if name in self.tenants:
            total.add(self.tenants[name].usage)
        return total

    def _activate(self: Scheduler, tenant: TenantState) -> None:
        if tenant.live == 0:
            active = [t for t in self.tenants.values() if t.live > 0]
            self.policy.on_tenant_active(tenant, active)
        tenant.live += 1

    def _retire(self: Scheduler, tenant: TenantState) -> None:
        """A tenant's last live request ended: drop its scheduling state, keep its usage.

        This is what keeps a flood of one-off tenant names from slowing every later step; the
        fair policy starts a returning tenant at the current minimum counter anyway, so the
        dropped virtual counter carried no credit worth keeping. What it used is added to its
        record here, and for a tenant only a client named to the sum of such tenants, which
        keeps `stats()` from summing every name ever seen.
        """
        del self.tenants[tenant.name]
        self.usage[tenant.name].add(tenant.usage)
        if not self.config.is_configured(tenant.name):
            self.other_usage.add(tenant.usage)

    def _enqueue(self: Scheduler, request: Request) -> None:
        self.waiting.push(request)
        self.tenants[request.tenant].waiting += 1

    def _leave_current_place(self: Scheduler, request: Request) -> None:
        """Take a request out of whichever queue or table holds it (not out of `requests`)."""
        rid = request.request_id
        if request.in_queue:
            self.waiting.remove(request)
            self.tenants[request.tenant].waiting -= 1
        elif request.state is PAUSED:
            self.paused.pop(rid, None)
        elif rid in self.running:
            del self.running[rid]
            self.prefilling.pop(rid, None)
            self.tenants[request.tenant].running -= 1

    def _drop_kv(self: Scheduler, request: Request, *, free: bool = True) -> None:
        """Release the request's blocks and forget what was computed into them."""
        self._charge_kv(request)
        if free and request.block_ids:
            self.block_manager.free(request.block_ids)
        request.block_ids = []  # a new list: plans already handed out keep their tables
        request.num_computed_tokens = 0
        self._reserved_blocks -= request.reserved_blocks
        request.reserved_blocks = 0
        seq = self._seqs.pop(request.request_id, None)
        if seq is not None:  # planned earlier in this very iteration: give its budget back
            if request.last_chunk_was_decode:
                self._budget += self.config.decode_weight
                self._planned_decodes -= 1
            else:
                self._budget += self.config.prefill_weight * len(seq.token_ids)
                self._planned_prefill -= len(seq.token_ids)
        request.scheduled_step = -1

    def _charge_kv(self: Scheduler, request: Request) -> None:
        """Add the block-seconds of the blocks held since the last change to the request's cost."""
        now = self.clock()
        if request.block_ids:
            cost = len(request.block_ids) * (now - request.kv_since)
            request.kv_block_seconds += cost
            self.tenants[request.tenant].usage.kv_block_seconds += cost
        request.kv_since = now

    def _preempt(self: Scheduler, request: Request) -> None:
        """Release a running (or paused) request's KV; it recomputes when admitted again."""
        self._drop_kv(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.tenants[request.tenant].usage.preemptions += 1
        if request.state is PAUSED:
            request.resume_state = PREEMPTED
            return
        self._leave_current_place(request)
        request.state = PREEMPTED
        self._enqueue(request)

    def _end(self: Scheduler, request: Request, reason: str, state: RequestState) -> RequestOutput:
        """The only way out: release every block now, leave every table, report usage."""
        self._leave_current_place(request)
        computed = request.num_computed_tokens
        self._drop_kv(request)
        request.num_computed_tokens = computed  # kept for inspection of the ended request
        rid = request.request_id
        del self.requests[rid]
        self.bisection.forget(rid)
        tenant = self.tenants[request.tenant]
        tenant.live -= 1
        tenant.usage.finished += 1
        if tenant.live == 0:
            self._retire(tenant)
        request.state = state
        request.finish_reason = reason
        request.finish_time = self.clock()
        self.ended_by_reason[reason] = self.ended_by_reason.get(reason, 0) + 1
        self.recently_ended[rid] = request
        if len(self.recently_ended) > _RECENT_LIMIT:
            self.recently_ended.popitem(last=False)
        return RequestOutput(
            request_id=rid,
            new_token_ids=[],
            finished=True,
            finish_reason=reason,
            prompt_tokens=len(request.prompt_token_ids),
            cached_tokens=request.num_cached_tokens,
            preemptions=request.num_preemptions,
            recomputed_tokens=request.num_recomputed_tokens,
        )
