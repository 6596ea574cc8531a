"""The scheduler: the queues, and every change of a request's state.

Synchronous and free of I/O: `schedule() -> StepPlan`, the executor runs it, `update(plan,
result) -> [RequestOutput]`. Each step a request's computed tokens catch up with its known
tokens, so prefill chunks, prefix hits, recomputes and decodes differ only in their numbers.
It owns every transition (add, preempt, pause, resume, requeue, expire, end), and `_end`
releases every block a request holds in the same call. What runs in a step is the planner's;
queues, blocks, tenants, policies and suspects belong to their own modules. See
docs/architecture.md, "Continuous batching and the scheduler core".
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from sluice.actors.scheduler.bisection import PoisonBisection
from sluice.actors.scheduler.config import SchedulerConfig, TenantConfig
from sluice.actors.scheduler.grammar_gate import GrammarGate
from sluice.actors.scheduler.invariants import check_invariants
from sluice.actors.scheduler.kv_cache import KVCacheManager
from sluice.actors.scheduler.plan import (RequestOutput, SampledToken, StepOutputs, StepPlan,
                                         StepResult)
from sluice.actors.scheduler.planner import Planner
from sluice.actors.scheduler.policy import make_policy
from sluice.actors.scheduler.request import FAILED_REASONS, Request, RequestState
from sluice.actors.scheduler.request_table import RequestTable
from sluice.actors.scheduler.tenant_ledger import TenantLedger
from sluice.actors.scheduler.tenant_limits import Deadlines, KVCaps
from sluice.ipc.vocabulary import FinishReason, InvalidRequestError, OverloadedError, TooLongError

PREFILLING, DECODING, PAUSED = RequestState.PREFILLING, RequestState.DECODING, RequestState.PAUSED


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig | None = None,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        max_model_len: int = 2048,
        kv_window: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`kv_window`: the model's attention window when every layer has one (0: none), the
        keys a query sees back to; KV blocks behind it are given back as requests run."""
        config = config or SchedulerConfig()
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.clock = clock
        self.kv_cache = KVCacheManager(
            config.kv_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching,
            high_watermark=config.kv_high_watermark, low_watermark=config.kv_low_watermark,
            window=kv_window,
        )
        self.policy = make_policy(config)
        self.ledger = TenantLedger(config, self.policy.on_tenant_active, clock)
        self.deadlines = Deadlines()  # of requests with a timeout
        self.table = table = RequestTable(self.policy, config.aging_seconds, self.ledger)
        # the table's places, to read (every move goes through the table)
        self.requests, self.waiting, self.running = table.requests, table.waiting, table.running
        self.prefilling, self.paused = table.prefilling, table.paused
        self.kv_caps = KVCaps(table.requests, self.ledger.limits, self.kv_cache.blocks_for)
        self.recently_ended = table.recently_ended
        self.num_preemptions = 0  # every cause
        self.num_priority_preemptions = 0  # of those, for a higher priority
        self.num_rejected = 0
        self.bisection = PoisonBisection()  # who may have killed the worker, and who runs next
        self._rng = random.Random(config.seed)
        # outputs of requests that ended while planning (a pool too small for one request)
        self._pending_outputs: list[RequestOutput] = []
        # grammars the worker has built: a constrained request is admitted once its is
        self.grammars = GrammarGate()
        self.planner = Planner(self, table, self.kv_cache, self.ledger, self.policy,
                               self.bisection, self.kv_caps, clock, self.grammars)

    @property
    def config(self) -> SchedulerConfig:
        """The settings, with the tenant table as the ledger has it now."""
        return self.ledger.config

    # -- requests in and out ----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request, or raise `Rejected` (invalid, too_long, quota, overloaded)."""
        try:
            self._validate(request)
        except Exception:
            self.num_rejected += 1
            self.ledger.count_rejection(request.tenant)
            raise
        self.ledger.clamp_priority(request)
        request.prepare(self.clock(), self._rng, self.eos_token_ids, self.max_model_len)
        self.table.add(request)
        self.grammars.add(request)
        self.ledger.queued_new(request)
        self.deadlines.watch(request, self.ledger.limits(request.tenant).timeout,
                             len(self.requests))

    def _validate(self, request: Request) -> None:
        request.check_fields()
        if request.request_id in self.requests:
            raise InvalidRequestError.about("request_id",
                                            f"{request.request_id!r} is already in use")
        self.ledger.check_exists(request.tenant)
        n = len(request.prompt_token_ids)
        if n + 1 > self.max_model_len:
            raise TooLongError.about("prompt_token_ids", f"{n} tokens leave no room to generate "
                                     f"within max_model_len {self.max_model_len}")
        self.kv_cache.check_fits(n, min(n + request.sampling.max_tokens, self.max_model_len))
        self.kv_caps.check(request)
        self.ledger.check_quota(request)
        if len(self.waiting) >= self.config.max_queued:
            raise OverloadedError.about("queue",
                                        f"{len(self.waiting)} requests are already waiting")

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED,
              error: str = "") -> RequestOutput | None:
        """End a request that did not finish by itself; None if it is unknown or already ended."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        state = RequestState.FAILED if reason in FAILED_REASONS else RequestState.CANCELLED
        return self._end(request, reason, state, error)

    def finish(self, request_id: str,
               reason: FinishReason = FinishReason.STOP) -> RequestOutput | None:
        """End a request that the engine found complete (a stop string matched)."""
        request = self.requests.get(request_id)
        return None if request is None else self._end(request, reason, RequestState.FINISHED)

    def expire(self) -> list[RequestOutput]:
        """End with TIMEOUT every request past its deadline, wherever it is (its blocks freed)."""
        outputs = []
        for request in self.deadlines.expired(self.clock()):
            if self.requests.get(request.request_id) is request:
                outputs.append(self._end(request, FinishReason.TIMEOUT, RequestState.CANCELLED))
        return outputs

    def next_deadline(self) -> float | None:
        """When `expire` may next have work (clock time), or None."""
        return self.deadlines.next_deadline()

    def pause(self, request_id: str) -> None:
        """Stop stepping a request (its client is slow); KV it holds is kept."""
        request = self.requests.get(request_id)
        if request is not None and request.state is not PAUSED:
            self.table.pause(request)

    def resume(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None and request.state is PAUSED:
            self.table.resume(request)

    def requeue_all(self) -> list[str]:
        """The KV pool is gone: everyone holding KV goes back to the queue to recompute."""
        requeued = []
        for request in [*self.running.values(), *self.paused.values()]:
            if not request.block_ids:
                continue
            requeued.append(request.request_id)
            self._drop_kv(request, free=False)
            self.table.requeue(request)
        self.kv_cache.reset()
        return requeued

    def charge_lost_step(self, plan: StepPlan | None, max_losses: int) -> list[RequestOutput]:
        """The worker died during `plan` (after `requeue_all`): suspect its requests.

        They are bisected in later plans (see `bisection.py`); a request that was alone in
        `max_losses` lost steps ends with ERROR, so it cannot hold the daemon in a restart
        loop, while the requests batched with it go on.
        """
        if plan is None:
            return []
        failed = self.bisection.step_lost(plan, self.requests, max_losses)
        return [self._end(self.requests[rid], FinishReason.ERROR, RequestState.FAILED) for rid in failed]

    def configure_tenant(self, name: str, tenant: TenantConfig) -> list[RequestOutput]:
        """Change a tenant's weight or limits at run time (operator command, config reload).

        A queued request that the tenant's new token rates can never take (it alone needs
        more than a bucket holds) ends with ERROR now instead of waiting for its deadline."""
        self.ledger.configure(name, tenant)
        outputs = []
        for request in [r for r in self.requests.values() if r.tenant == name]:
            if request.rate_charged or (field := self.ledger.rates.exceeds(request)) is None:
                continue
            why = (f"tenant {name!r}'s token rates were lowered below what this request's "
                   f"{field} needs")
            outputs.append(self._end(request, FinishReason.ERROR, RequestState.FAILED, why))
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def get_request(self, request_id: str) -> Request | None:
        """A live request, or one of the recently ended ones."""
        return self.table.get(request_id)

    # -- planning ---------------------------------------------------------------------------
    def schedule(self, token_budget: float | None = None) -> StepPlan:
        """Plan one iteration within the token budget (the configured one unless given: a
        step that ran out of memory is planned smaller); see `planner.py`."""
        plan = self.planner.schedule(token_budget)
        plan.grammars = self.grammars.take_asks()
        return plan

    # -- results ----------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> StepOutputs:
        """Apply one executed step: advance computed tokens, append samples, end what is done.
        A request that goes on with one token and asked for no logprobs is a row of the
        outputs' columns; every other output is a `RequestOutput`."""
        outputs, self._pending_outputs = self._pending_outputs, []
        request_ids: list[str] = []
        token_ids: list[int] = []
        detailed = result.logprobs
        now = self.clock()
        kv, ledger, tenants = self.kv_cache, self.ledger, self.ledger.tenants
        sampled, step_id, size = result.sampled, plan.step_id, kv.block_size
        if result.grammars_built:
            self.grammars.built(result.grammars_built)
        # the step's forward time, shared among its sequences by the tokens each computed
        forward = result.forward_seconds
        per_token = forward / max(1, plan.num_tokens) if forward else 0.0
        requests, max_model_len = self.requests, self.max_model_len
        for seq in plan.seqs:
            request = requests.get(seq.request_id)
            if request is None or request.scheduled_step != step_id or not request.block_ids:
                continue  # ended, preempted or requeued since it was planned
            tenant = tenants[request.tenant]
            start = seq.start_pos
            end = start + len(seq.token_ids)
            if per_token:
                request.compute_seconds += per_token * (end - start)
            recomputed = request.computed(start, end)
            if not request.last_chunk_was_decode:
                ledger.charge_prefill(tenant, end - start - recomputed, recomputed)
            if end // size > start // size:
                kv.register_computed(request, start, end, tenant.config)
            if kv.window:  # the blocks its window has moved past go back to the pool
                ledger.charge_kv(request, now)
                kv.free_unseen(request)
            if not seq.sample:
                if end >= len(request.all_token_ids):
                    self.table.prefill_done(request, now)
                continue
            token_id = sampled.get(seq.request_id)
            if token_id is None:
                outputs.append(self._end(request, FinishReason.ERROR, RequestState.FAILED))
                continue
            if request.state is not DECODING:  # its first token: the prompt is computed
                self.table.prefill_done(request, now)
            ledger.charge_decode(tenant)
            reason = request.sampled(token_id, now, max_model_len)
            logprobs = request.sampling.logprobs is not None
            if reason is not None:
                output = self._end(request, reason, RequestState.FINISHED)
                output.new_token_ids = [token_id]
            elif not logprobs:
                request_ids.append(seq.request_id)
                token_ids.append(token_id)
                continue
            else:
                output = RequestOutput(request.request_id, [token_id])
            if logprobs:  # an executor that computes none gives the token alone
                output.logprobs = [detailed.get(seq.request_id) or SampledToken(token_id)]
            outputs.append(output)
        self.bisection.step_done(plan, self.requests)
        return StepOutputs(request_ids, token_ids, outputs)

    def step_not_run(self, plan: StepPlan) -> StepOutputs:
        """`plan` did not run (out of memory): its requests give back the blocks it took and
        are planned again from their computed tokens. Returns what ended while planning."""
        for request in filter(None, map(self.requests.get, (s.request_id for s in plan.seqs))):
            if request.scheduled_step == plan.step_id:
                self.ledger.charge_kv(request, self.clock())
                self.kv_cache.trim_to_computed(request)
                request.scheduled_step = -1
        outputs, self._pending_outputs = self._pending_outputs, []
        return StepOutputs(outputs=outputs)

    # -- losing KV and ending -----------------------------------------------------------------
    def _drop_kv(self, request: Request, *, free: bool = True) -> None:
        """Release the request's blocks and forget what was computed into them."""
        self.ledger.charge_kv(request, self.clock())
        self.kv_cache.release(request, free=free)
        request.num_computed_tokens = 0
        if self.planner.plan is not None:  # planned earlier in this iteration: not any more
            self.planner.plan.undo(request)
        request.scheduled_step = -1

    def preempt(self, request: Request, *, for_priority: bool = False) -> None:
        """Release a running (or paused) request's KV; it recomputes when admitted again. One
        that memory pressure preempted `max_preemptions` times ends instead (it thrashes)."""
        cap = self.config.max_preemptions
        if not for_priority and cap is not None and \
                request.num_preemptions - request.num_priority_preemptions >= cap:
            self.end_while_planning(request, FinishReason.PREEMPTED_ABORT)
            return
        self._drop_kv(request)
        request.num_preemptions += 1
        request.num_priority_preemptions += for_priority
        self.num_priority_preemptions += for_priority
        self.num_preemptions += 1
        self.ledger.charge_preemption(request.tenant)
        self.table.requeue(request)

    def end_while_planning(self, request: Request, reason: FinishReason) -> None:
        """End a request that planning cannot serve (alone too big for the pool, or
        thrashing); its output goes out with the next update."""
        state = RequestState.FINISHED if reason is FinishReason.LENGTH else RequestState.FAILED
        self._pending_outputs.append(self._end(request, reason, state))

    def _end(self, request: Request, reason: FinishReason, state: RequestState,
             error: str = "") -> RequestOutput:
        """The only way out: release every block now, leave every table, report usage."""
        computed = request.num_computed_tokens
        self._drop_kv(request)
        request.num_computed_tokens = computed  # kept for inspection of the ended request
        self.ledger.request_ended(request)
        self.table.remove(request, reason)
        self.grammars.remove(request)
        self.bisection.forget(request.request_id)
        return request.ended(reason, state, self.clock(), error,
                             configured=self.config.is_configured(request.tenant))

    # -- inspection -------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError describing every broken rule; call between steps."""
        check_invariants(self.table, self.kv_cache, self.ledger)

    def stats(self) -> dict[str, Any]:
        """Queue lengths per state and tenant, KV numbers, preemptions and per-tenant service."""
        queues, per_tenant = self.table.counts()
        return {
            "step": self.planner.step_id,
            "queues": queues,
            "kv": self.kv_cache.stats(),
            "last_step": dict(self.planner.last_step),
            "preemptions": self.num_preemptions,
            "priority_preemptions": self.num_priority_preemptions,
            "rejected": self.num_rejected,
            "ended": {r.name.lower(): n for r, n in self.table.ended_by_reason.items()},
            "policy": self.config.policy,
            **self.ledger.stats(per_tenant),
        }
