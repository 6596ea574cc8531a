"""The scheduler core: admission, one plan per iteration, and turning results into outputs.

Synchronous and free of I/O: `schedule() -> StepPlan`, the executor runs it, `update(plan,
result) -> [RequestOutput]`. One rule covers every kind of work: each step a request's
computed tokens catch up with its known tokens (prompt + generated), so a prefill chunk, a
prefix-cache hit, a recompute after preemption and a decode differ only in their numbers.
Lifecycle operations outside a step (abort, pause, requeue) are in `lifecycle.py`; checks and
snapshots in `inspection.py`. After a lost worker, a plan may be limited to one group of
suspects (`bisection.py` says which) so that the request that kills the worker is found.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable

from sluice.actors.scheduler.admission import AdmissionMixin
from sluice.actors.scheduler.bisection import PoisonBisection
from sluice.actors.scheduler.block_manager import BlockManager
from sluice.actors.scheduler.config import SchedulerConfig
from sluice.actors.scheduler.inspection import InspectionMixin
from sluice.actors.scheduler.lifecycle import LifecycleMixin
from sluice.actors.scheduler.plan import (
    RequestOutput,
    ScheduledSeq,
    StepPlan,
    StepResult,
)
from sluice.actors.scheduler.policy import (
    TenantState,
    TenantUsage,
    make_policy,
    preemption_key,
)
from sluice.actors.scheduler.request import Request, RequestState
from sluice.actors.scheduler.wait_queue import WaitQueue

WAITING, PREFILLING, DECODING = RequestState.WAITING, RequestState.PREFILLING, RequestState.DECODING
PAUSED, PREEMPTED = RequestState.PAUSED, RequestState.PREEMPTED


class Scheduler(AdmissionMixin, LifecycleMixin, InspectionMixin):
    def __init__(
        self,
        config: SchedulerConfig | None = None,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        max_model_len: int = 2048,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.config = config = config or SchedulerConfig()
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.clock = clock
        self.block_manager = BlockManager(
            config.kv_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.policy = make_policy(config)
        self.waiting = WaitQueue(self.policy, config.aging_seconds)
        self.running: dict[str, Request] = {}  # prefilling and decoding, in admission order
        self.prefilling: dict[str, Request] = {}  # the prefilling subset of `running`
        self.paused: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}  # every request not yet ended
        self.tenants: dict[str, TenantState] = {}  # tenants with live requests only
        # what each tenant that ever ran has used, as of when it last went idle (metrics and
        # billing read it); `tenant_usage(name)` adds what an active tenant used since
        self.usage: dict[str, TenantUsage] = {}
        self.other_usage = TenantUsage()  # the same summed over idle client-named tenants
        self.recently_ended: OrderedDict[str, Request] = OrderedDict()
        self.num_preemptions = 0
        self.num_rejected = 0
        self.ended_by_reason: dict[str, int] = {}
        self._step_id = 0
        self._rng = random.Random(config.seed)
        self._admission_open = True
        self._reserved_blocks = 0
        self._budget = 0.0
        self._seqs: dict[str, ScheduledSeq] = {}
        # outputs of requests that ended while planning (a pool too small for one request)
        self._pending_outputs: list[RequestOutput] = []
        self._preemptions_at_start = 0
        self._last_schedule_time: float | None = None
        self._planned_prefill = self._planned_decodes = 0
        self.last_step: dict[str, float] = {}  # composition of the latest plan, for snapshots
        self._iteration_seconds = 0.0  # between the last two schedule() calls, for aging
        self.bisection = PoisonBisection()  # who may have killed the worker, and who runs next
        self._probe: frozenset[str] | None = None  # the suspects this plan is limited to

    # -- planning -------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Plan one iteration: decode tokens and prefill chunks within the token budget."""
        now = self.clock()
        if self._last_schedule_time is not None:
            self._iteration_seconds = now - self._last_schedule_time
        self._last_schedule_time = now
        self._step_id += 1
        cfg = self.config
        self._seqs = {}
        self._budget = float(cfg.token_budget)
        self._planned_prefill = self._planned_decodes = 0
        self._preemptions_at_start = self.num_preemptions
        self._probe = self.bisection.probe_group(self.requests)
        self._plan_in_order(now)
        if self._probe is not None and not self._seqs:
            # the suspects cannot run now (no KV for them): let the others run and free some
            self._probe = None
            self._plan_in_order(now)
        self._probe = None
        plan = StepPlan(step_id=self._step_id, seqs=list(self._seqs.values()))
        self._seqs = {}
        self.last_step = {
            "seqs": len(plan.seqs),
            "prefill_tokens": self._planned_prefill,
            "decode_tokens": self._planned_decodes,
            "budget_used": cfg.token_budget - self._budget,
            "token_budget": cfg.token_budget,
        }
        return plan

    def _plan_in_order(self, now: float) -> None:
        cfg = self.config
        if cfg.order == "decode_first":
            self._schedule_decodes()
            self._schedule_prefills(now)
        else:
            pending_decodes = len(self.running) - len(self.prefilling)
            held_back = min(
                cfg.decode_share * cfg.token_budget, cfg.decode_weight * pending_decodes
            )
            self._budget -= held_back
            self._schedule_prefills(now)
            self._budget += held_back
            self._schedule_decodes()

    def _may_plan(self, request: Request) -> bool:
        """While a suspect group is probed only its members run; else everyone but suspects."""
        if self._probe is not None:
            return request.request_id in self._probe
        suspects = self.bisection.suspects
        return not suspects or request.request_id not in suspects

    def _next_probe_admission(self) -> Request | None:
        """The queued member of the probed group that arrived first."""
        members = (self.requests.get(rid) for rid in self._probe or ())
        queued = [r for r in members if r is not None and r.in_queue]
        return min(queued, key=preemption_key, default=None)

    def _schedule_decodes(self) -> None:
        w_d = self.config.decode_weight
        capacity = self.block_manager.block_size
        candidates = list(self.running.values())
        if candidates and w_d * (len(candidates) - len(self.prefilling)) > self._budget:
            # more decodes than budget: rotate who goes first so no stream stalls for good
            k = self._step_id % len(candidates)
            candidates = candidates[k:] + candidates[:k]
        for request in candidates:
            if self._budget < w_d:
                break
            if request.state is not DECODING or not self._may_plan(request):
                continue
            start = request.num_computed_tokens
            if start >= len(request.all_token_ids):  # the toy mode's first decode
                start -= 1
            if start + 1 > len(request.block_ids) * capacity:
                if not self._grow(request, 1, may_preempt_self=True):
                    continue
            self._emit(request, start, 1, decode=True)
            self._budget -= w_d
            self._planned_decodes += 1

    def _schedule_prefills(self, now: float) -> None:
        cfg = self.config
        w_p = cfg.prefill_weight
        if self._budget < w_p:
            return
        for request in self.policy.prefill_order(list(self.prefilling.values()), self.tenants):
            if self._budget < w_p:
                return
            if (
                request.state is PREFILLING
                and request.request_id not in self._seqs
                and self._may_plan(request)
            ):
                self._schedule_chunk(request, may_preempt=True)
        while (
            len(self.prefilling) < cfg.max_prefilling
            and len(self.running) < cfg.max_running
            and self._budget >= w_p
            and len(self.waiting)
            # a step that had to preempt has no KV to spare for newcomers
            and self.num_preemptions == self._preemptions_at_start
            and self._admission_allowed()
        ):
            if self._probe is not None:
                request = self._next_probe_admission()
            else:
                request = self.waiting.select(
                    now, self.tenants, self._tenant_may_run, self._iteration_seconds
                )
                if request is not None and not self._may_plan(request):
                    return  # a suspect is next in line: it waits for its probe
            if request is None or not self._admit(request, now):
                return

    def _schedule_chunk(self, request: Request, *, may_preempt: bool) -> bool:
        cfg = self.config
        bm = self.block_manager
        start = request.num_computed_tokens
        n = min(
            len(request.all_token_ids) - start,
            cfg.max_prefill_chunk,
            int(self._budget // cfg.prefill_weight),
        )
        if n <= 0:
            return False
        missing = bm.blocks_for(start + n) - len(request.block_ids)
        if missing > 0 and not bm.can_allocate(missing):
            if not (may_preempt and self._grow(request, missing, may_preempt_self=False)):
                # take what the pool has left rather than stall the whole chunk
                fits = (len(request.block_ids) + bm.num_available_blocks) * bm.block_size - start
                n = min(n, fits)
                if n <= 0:
                    return False
                missing = bm.blocks_for(start + n) - len(request.block_ids)
                if missing > 0:
                    self._charge_kv(request)
                    request.block_ids.extend(bm.allocate(missing))
        elif missing > 0:
            self._charge_kv(request)
            request.block_ids.extend(bm.allocate(missing))
        self._emit(request, start, n, decode=False)
        self._budget -= cfg.prefill_weight * n
        self._planned_prefill += n
        return True

    def _emit(self, request: Request, start: int, n: int, *, decode: bool) -> None:
        tokens = request.all_token_ids
        end = start + n
        outputs = request.output_token_ids
        sample = end >= len(tokens) and (
            decode or self.config.first_token_from_prefill or bool(outputs)
        )
        penalties = request.has_penalties
        self._seqs[request.request_id] = ScheduledSeq(
            request.request_id,
            tokens[start:end],
            start,
            request.block_ids,
            sample,
            request.sampling,
            len(outputs),
            request.sampling_seed,
            request.prompt_token_ids if penalties else None,
            list(outputs) if penalties else None,
        )
        request.scheduled_step = self._step_id
        request.last_chunk_was_decode = decode
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()

    def _grow(self, request: Request, num_blocks: int, *, may_preempt_self: bool) -> bool:
        """Give `request` more blocks, preempting lower-ranked requests while the pool is short.

        When `request` itself ranks lowest, a decode is preempted (`may_preempt_self`) and a
        prefill simply waits; a request alone in a pool too small for it ends with "length".
        """
        bm = self.block_manager
        while not bm.can_allocate(num_blocks):
            victim = self._pick_victim(exclude=request)
            if victim is None or preemption_key(victim) < preemption_key(request):
                if victim is None and may_preempt_self:
                    self._pending_outputs.append(
                        self._end(request, "length", RequestState.FINISHED)
                    )
                elif may_preempt_self:
                    self._preempt(request)
                return False
            self._preempt(victim)
        self._charge_kv(request)
        request.block_ids.extend(bm.allocate(num_blocks))
        return True

    def _pick_victim(self, exclude: Request) -> Request | None:
        candidates = [
            r
            for r in (*self.running.values(), *self.paused.values())
            if r is not exclude and r.block_ids
        ]
        return max(candidates, key=preemption_key) if candidates else None

    # -- results --------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Apply one executed step: advance computed tokens, append samples, end what is done."""
        outputs, self._pending_outputs = self._pending_outputs, []
        now = self.clock()
        bm = self.block_manager
        caching = bm.enable_prefix_caching
        size = bm.block_size
        cost_p, cost_d = self.config.fair_prompt_cost, self.config.fair_output_cost
        sampled = result.sampled
        step_id = plan.step_id
        for seq in plan.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.scheduled_step != step_id or not request.block_ids:
                continue  # ended, preempted or requeued since it was planned
            tenant = self.tenants[request.tenant]
            usage = tenant.usage
            start = seq.start_pos
            end = start + len(seq.token_ids)
            if not request.last_chunk_was_decode:
                recomputed = max(0, min(end, request.max_computed_tokens) - start)
                fresh = end - start - recomputed
                request.num_recomputed_tokens += recomputed
                usage.recomputed_tokens += recomputed
                request.num_prefill_tokens += fresh
                usage.prefill_tokens += fresh
                charge = cost_p * fresh
                usage.service += charge
                tenant.virtual_time += charge / tenant.config.weight
            if end > request.num_computed_tokens:
                request.num_computed_tokens = end
            if end > request.max_computed_tokens:
                request.max_computed_tokens = end
            if caching and end // size > start // size:
                for index in range(start // size, end // size):
                    bm.register(request.block_ids[index], self._block_hash(request, index))
            if not seq.sample:
                if end >= len(request.all_token_ids):
                    self._mark_decoding(request, now)
                continue
            token = sampled.get(seq.request_id)
            if token is None:
                outputs.append(self._end(request, "error", RequestState.FAILED))
                continue
            self._mark_decoding(request, now)
            token_id = token.token_id
            request.output_token_ids.append(token_id)
            request.all_token_ids.append(token_id)
            request.num_decode_tokens += 1
            usage.decode_tokens += 1
            usage.service += cost_d
            tenant.virtual_time += cost_d / tenant.config.weight
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            reason = None
            if token_id in request.stop_ids:
                reason = "stop"
            elif (
                len(request.output_token_ids) >= request.sampling.max_tokens
                or len(request.all_token_ids) >= self.max_model_len
            ):
                reason = "length"
            if reason is not None:
                output = self._end(request, reason, RequestState.FINISHED)
                output.new_token_ids = [token_id]
            else:
                output = RequestOutput(request.request_id, [token_id])
            if request.sampling.logprobs is not None:
                output.logprobs = [token]
            outputs.append(output)
        self.bisection.step_done(plan, self.requests)
        return outputs

    def _mark_decoding(self, request: Request, now: float) -> None:
        if request.state is PREFILLING:
            request.state = DECODING
            self.prefilling.pop(request.request_id, None)
            request.prefill_done_time = now
        elif request.state is PAUSED and request.resume_state is PREFILLING:
            request.resume_state = DECODING
            request.prefill_done_time = now
