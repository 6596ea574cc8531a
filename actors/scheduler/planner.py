"""Planning one iteration: which decodes and prefill chunks run, within the token budget.

`Planner.schedule` fills a `PlanBuilder` (the state of one planning iteration, with an undo):
decodes (rotated when they outnumber the budget), chunks of prompts being prefilled, and
admissions from the wait queue in the policy's order, within the tenants' caps, rates and
KV caps; under the priority policy, an arrival that outranks requests holding KV takes
their place. It finds the KV each piece needs, preempting lower-ranked requests while the
pool is short. Every change of a request's place or end is the scheduler's
(`scheduler.py`): the planner asks for it through `Transitions`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from sluice.actors.scheduler.bisection import PoisonBisection
from sluice.actors.scheduler.config import SchedulerConfig
from sluice.actors.scheduler.grammar_gate import GrammarGate
from sluice.actors.scheduler.kv_cache import KVCacheManager
from sluice.actors.scheduler.plan import StepPlan
from sluice.actors.scheduler.plan_builder import PlanBuilder
from sluice.actors.scheduler.policy import Policy, preemption_key
from sluice.actors.scheduler.request import Request, RequestState
from sluice.actors.scheduler.request_table import RequestTable
from sluice.actors.scheduler.tenant_ledger import TenantLedger, TenantState
from sluice.actors.scheduler.tenant_limits import KVCaps
from sluice.ipc.vocabulary import FinishReason

PREFILLING, DECODING = RequestState.PREFILLING, RequestState.DECODING


class Transitions(Protocol):
    """What planning asks of the scheduler, which owns every change of a request's place."""

    num_preemptions: int

    def preempt(self, request: Request, *, for_priority: bool = False) -> None: ...

    def end_while_planning(self, request: Request, reason: FinishReason) -> None: ...


class Planner:
    def __init__(self, core: Transitions, table: RequestTable, kv_cache: KVCacheManager,
                 ledger: TenantLedger, policy: Policy, bisection: PoisonBisection,
                 kv_caps: KVCaps, clock: Callable[[], float], grammars: GrammarGate):
        self.core = core
        self.grammars = grammars
        self.table = table
        self.requests, self.waiting, self.running = table.requests, table.waiting, table.running
        self.prefilling, self.paused = table.prefilling, table.paused
        self.kv_cache, self.ledger, self.policy = kv_cache, ledger, policy
        self.bisection, self.kv_caps, self.clock = bisection, kv_caps, clock
        self.step_id = 0
        self.plan: PlanBuilder | None = None  # while schedule() runs
        self.last_step: dict[str, float] = {}  # composition of the latest plan, for snapshots
        self.last_schedule_time: float | None = None
        self.iteration_seconds = 0.0  # between the last two schedule() calls, for aging

    @property
    def config(self) -> SchedulerConfig:
        return self.ledger.config

    def schedule(self, token_budget: float | None = None) -> StepPlan:
        """Plan one iteration: decode tokens and prefill chunks within the token budget
        (the configured one unless given: a step that ran out of memory is planned smaller)."""
        now = self.clock()
        if self.last_schedule_time is not None:
            self.iteration_seconds = now - self.last_schedule_time
        self.last_schedule_time = now
        self.step_id += 1
        plan = self.plan = PlanBuilder(
            self.step_id, self.config, self.clock,
            probe=self.bisection.probe_group(self.requests), preemptions=self.core.num_preemptions,
            token_budget=token_budget,
        )
        self._plan_in_order(plan, now)
        if plan.probe is not None and not plan.seqs:
            # the suspects cannot run now (no KV for them): let the others run and free some
            plan.probe = None
            self._plan_in_order(plan, now)
        self.plan = None
        self.last_step = plan.composition()
        return plan.build()

    def _plan_in_order(self, plan: PlanBuilder, now: float) -> None:
        cfg = self.config
        if cfg.order == "decode_first":
            self._schedule_decodes(plan)
            self._schedule_prefills(plan, now)
        else:
            pending_decodes = len(self.running) - len(self.prefilling)
            plan.hold_back(min(cfg.decode_share * plan.token_budget,
                               cfg.decode_weight * pending_decodes))
            self._schedule_prefills(plan, now)
            plan.release()
            self._schedule_decodes(plan)

    def _schedule_decodes(self, plan: PlanBuilder) -> None:
        capacity = self.kv_cache.block_size
        candidates = list(self.running.values())
        decodes = len(candidates) - len(self.prefilling)
        if candidates and plan.decode_weight * decodes > plan.budget:
            # more decodes than budget: rotate who goes first so no stream stalls for good
            k = plan.step_id % len(candidates)
            candidates = candidates[k:] + candidates[:k]
        suspects = self.bisection.suspects
        anyone = plan.probe is None and not suspects  # no suspect group limits who runs
        weight = plan.decode_weight
        for request in candidates:
            if plan.budget < weight:
                break
            if request.state is not DECODING or not (anyone or plan.may_plan(request, suspects)):
                continue
            start = request.num_computed_tokens
            if start >= len(request.all_token_ids):  # the toy mode's first decode
                start -= 1
            if start + 1 > len(request.block_ids) * capacity:
                if not self._within_kv_cap(request) or not self._grow(request, 1,
                                                                       may_preempt_self=True):
                    continue
            plan.add_decode(request, start)

    def _schedule_prefills(self, plan: PlanBuilder, now: float) -> None:
        cfg = self.config
        if not plan.can_prefill:
            return
        for request in self.policy.prefill_order(list(self.prefilling.values()),
                                                 self.ledger.tenants):
            if not plan.can_prefill:
                return
            if (request.state is PREFILLING and request.request_id not in plan
                    and plan.may_plan(request, self.bisection.suspects)):
                self._schedule_chunk(plan, request, may_preempt=True)
        while (
            len(self.prefilling) < cfg.max_prefilling
            and len(self.running) < cfg.max_running
            and plan.can_prefill
            and len(self.waiting)
            # a step that had to preempt has no KV to spare for newcomers
            and self.core.num_preemptions == plan.preemptions_at_start
            and self.kv_cache.may_admit(bool(self.running))
        ):
            if plan.probe is not None:
                request = plan.first_queued_suspect(self.requests)
            else:
                request = self.waiting.select(now, self.ledger.tenants, self._may_start,
                                              self.iteration_seconds)
                if request is not None and not plan.may_plan(request, self.bisection.suspects):
                    return  # a suspect is next in line: it waits for its probe
            if request is None or not self._admit(plan, request):
                break
        if cfg.policy == "priority" and plan.probe is None:
            self._admit_by_priority(plan, now)

    def _admit_by_priority(self, plan: PlanBuilder, now: float) -> None:
        """A newcomer that outranks requests holding KV takes their place when nothing else
        made room for it: the lowest-ranked are preempted (for priority: not counted against
        `max_preemptions`) until it is admitted."""
        if not (plan.can_prefill and len(self.prefilling) < self.config.max_prefilling
                and self.core.num_preemptions == plan.preemptions_at_start):
            return
        request = self.waiting.select(now, self.ledger.tenants, self._may_start,
                                      self.iteration_seconds)
        if request is None or not plan.may_plan(request, self.bisection.suspects):
            return
        while (victim := max((r for r in (*self.running.values(), *self.paused.values())
                              if r.block_ids), key=preemption_key, default=None)) is not None \
                and victim.priority < request.priority:
            self.core.preempt(victim, for_priority=True)
            if len(self.running) < self.config.max_running and self._admit(plan, request):
                return

    def _admit(self, plan: PlanBuilder, request: Request) -> bool:
        """Move the policy's pick from the queue into the running set with its first chunk."""
        kv, reserve = self.kv_cache, self.config.admission == "reserve"
        if reserve and not kv.can_reserve(request):
            return False
        hits = kv.acquire_prefix(request, self.ledger.tenants[request.tenant].config)
        start = len(hits) * kv.block_size
        if not kv.can_allocate(kv.blocks_for(start + 1) - len(hits)):
            kv.free(hits)
            return False
        self.table.start_prefill(request)
        self.ledger.admitted(request)
        if reserve:
            kv.reserve(request)
        request.kv_since = self.clock()
        request.block_ids = hits
        request.num_computed_tokens = start
        if request.max_computed_tokens == 0:
            request.num_cached_tokens = start
            self.ledger.charge_cached(request.tenant, start)
        self._schedule_chunk(plan, request, may_preempt=False)
        return True

    def _schedule_chunk(self, plan: PlanBuilder, request: Request, *, may_preempt: bool) -> None:
        kv = self.kv_cache
        start = request.num_computed_tokens
        n = min(len(request.all_token_ids) - start, self.config.max_prefill_chunk,
                plan.prefill_room)
        if n <= 0:
            return
        room = self.kv_caps.room(request.tenant)
        if room is not None and kv.blocks_for(start + n) - len(request.block_ids) > room:
            # its tenant's KV cap: only the chunk that fits, or wait for the tenant's own ends
            n = (len(request.block_ids) + room) * kv.block_size - start
            if n <= 0:
                return
        missing = kv.blocks_for(start + n) - len(request.block_ids)
        if missing > 0 and not kv.can_allocate(missing):
            if not (may_preempt and self._grow(request, missing, may_preempt_self=False)):
                # take what the pool has left rather than stall the whole chunk
                fits = (len(request.block_ids) + kv.num_available_blocks) * kv.block_size - start
                n = min(n, fits)
                if n <= 0:
                    return
                missing = kv.blocks_for(start + n) - len(request.block_ids)
                if missing > 0:
                    self._take_blocks(request, missing)
        elif missing > 0:
            self._take_blocks(request, missing)
        plan.add_prefill(request, start, n)

    def _grow(self, request: Request, num_blocks: int, *, may_preempt_self: bool) -> bool:
        """Give `request` more blocks, preempting lower-ranked requests while the pool is short.

        When `request` itself ranks lowest, a decode is preempted (`may_preempt_self`) and a
        prefill simply waits; a request alone in a pool too small for it ends with LENGTH.
        """
        while not self.kv_cache.can_allocate(num_blocks):
            candidates = [r for r in (*self.running.values(), *self.paused.values())
                          if r is not request and r.block_ids]
            victim = max(candidates, key=preemption_key) if candidates else None
            if victim is None or preemption_key(victim) < preemption_key(request):
                if victim is None and may_preempt_self:
                    self.core.end_while_planning(request, FinishReason.LENGTH)
                elif may_preempt_self:
                    self.core.preempt(request)
                return False
            self.core.preempt(victim)
        self._take_blocks(request, num_blocks)
        return True

    def _may_start(self, tenant: TenantState, request: Request) -> bool:
        """The tenant's next in line may be admitted: its caps, its rates, its KV cap, and
        the worker has built its grammar."""
        return (self.ledger.may_start(tenant, request) and self.kv_caps.fits_prompt(request)
                and self.grammars.ready(request))

    def _within_kv_cap(self, request: Request) -> bool:
        """Room for one more block under its tenant's KV cap, preempting the tenant's own
        youngest for it; False when that was `request` itself."""
        while (victim := self.kv_caps.make_way(request)) is not None:
            self.core.preempt(victim)
            if victim is request:
                return False
        return True

    def _take_blocks(self, request: Request, num_blocks: int) -> None:
        self.ledger.charge_kv(request, self.clock())
        self.kv_cache.grow(request, num_blocks)
