"""The tenant ledger: what each tenant may use and what it has used.

It owns the tenants' limits (the scheduler config's tenant table, changed at run time by
`configure`), the scheduling state of every tenant with a live request (`TenantState`: its
counters and the fair policy's virtual time), and the usage of every tenant that ever ran
(`TenantUsage`, kept while the tenant is idle because metrics and billing count it). The
scheduler tells it when a request of a tenant arrives, moves, runs and ends; it answers
whether a request is within its tenant's quota and whether a tenant may run one more. The
token buckets of tenants with rates are `tenant_limits.TenantRates`, kept here.
Which request runs next is the policy's (`policy.py`); the queues are the scheduler's.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sluice.actors.scheduler.config import DEFAULT_TENANT, SchedulerConfig, TenantConfig
from sluice.actors.scheduler.request import Request
from sluice.actors.scheduler.tenant_limits import TenantRates
from sluice.ipc.vocabulary import InvalidRequestError, QuotaError


@dataclass(slots=True)
class TenantUsage:
    """What one tenant has used since the scheduler started; kept while the tenant is idle,
    because metrics and billing count it (the per-request usage records are the bill itself)."""

    service: float = 0.0  # c_p * prompt tokens + c_d * output tokens computed
    prefill_tokens: int = 0
    decode_tokens: int = 0
    recomputed_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    kv_block_seconds: float = 0.0
    finished: int = 0
    rejected: int = 0

    def add(self, other: TenantUsage) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class TenantState:
    """What the scheduler needs to schedule one tenant that has live requests.

    It exists only while the tenant has a live request: an idle tenant's scheduling state is
    dropped (so one-off tenant names cost nothing per step), its `usage` is kept.
    """

    name: str
    config: TenantConfig
    usage: TenantUsage  # since it became active; added to its record when it goes idle
    virtual_time: float = 0.0  # service / weight since the tenant became active, fair policy
    live: int = 0  # requests not ended (waiting, running, paused or preempted)
    waiting: int = 0
    running: int = 0  # requests holding KV (prefilling or decoding), not counting paused
    # paused ones (their client stopped reading): they keep their place under `max_running`,
    # so a client that stops reading does not free a slot for another of its requests
    paused: int = 0
    # prompt tokens and max_tokens of its requests that wait for their first admission (what
    # its token buckets must still pay for)
    queued_input: int = 0
    queued_output: int = 0


# the policy's hook for a tenant that had no live request and now has one
OnTenantActive = Callable[[TenantState, Sequence[TenantState]], None]


class TenantLedger:
    def __init__(self, config: SchedulerConfig, on_tenant_active: OnTenantActive,
                 clock: Callable[[], float]):
        self.config = config
        self.on_tenant_active = on_tenant_active
        self.clock = clock
        self.rates = TenantRates()
        for name, tenant in config.tenants.items():
            self.rates.configure(name, tenant, clock())
        self.tenants: dict[str, TenantState] = {}  # tenants with live requests only
        # what each tenant that ever ran has used, as of when it last went idle (metrics and
        # billing read it); `tenant_usage(name)` adds what an active tenant used since
        self.usage: dict[str, TenantUsage] = {}
        self.other_usage = TenantUsage()  # the same summed over idle client-named tenants

    # -- limits ---------------------------------------------------------------------------
    def configure(self, name: str, tenant: TenantConfig) -> SchedulerConfig:
        """Change a tenant's weight or limits; returns the config with the new tenant table.

        New limits apply to later admissions; requests already queued or running keep going
        (the scheduler ends a queued one the new rates can never take).
        """
        tenants = dict(self.config.tenants)
        tenants[name] = tenant
        self.config = dataclasses.replace(self.config, tenants=tenants)
        self.rates.configure(name, tenant, self.clock())
        if name in self.tenants:  # an idle tenant picks its config up when it becomes active
            self.tenants[name].config = tenant
        return self.config

    def limits(self, name: str) -> TenantConfig:
        return self.config.tenant(name)

    def check_exists(self, name: object) -> None:
        """Raise `InvalidRequestError` for a tenant a request may not name; checked before any
        other tenant check, so an invented name costs no table entry."""
        if not isinstance(name, str) or not self.config.tenant_exists(name):
            raise InvalidRequestError.about(
                "tenant", f"{name!r} is not a tenant here (an operator creates tenants)"
            )

    def check_quota(self, request: Request) -> None:
        """Raise `QuotaError` when the request is beyond what its tenant may ask for or queue."""
        limits = self.config.tenant(request.tenant)
        max_tokens = request.sampling.max_tokens
        n = len(request.prompt_token_ids)
        if limits.max_new_tokens is not None and max_tokens > limits.max_new_tokens:
            raise QuotaError.about(
                "max_tokens", f"tenant {request.tenant!r} allows at most {limits.max_new_tokens}, "
                f"got {max_tokens}"
            )
        if limits.max_context is not None and n + max_tokens > limits.max_context:
            raise QuotaError.about(
                "prompt_token_ids", f"prompt + max_tokens = {n + max_tokens} "
                f"exceeds tenant {request.tenant!r}'s max_context {limits.max_context}"
            )
        tenant = self.tenants.get(request.tenant)
        queued = tenant.waiting if tenant is not None else 0  # no state yet: nothing queued
        max_queued = self.config.max_queued_of(request.tenant)
        if max_queued is not None and queued >= max_queued:
            raise QuotaError.about(
                "tenant", f"{request.tenant!r} already has {queued} requests queued "
                f"(max_queued {max_queued})"
            )
        self._check_rates(request, limits, tenant)

    def _check_rates(self, request: Request, limits: TenantConfig,
                     tenant: TenantState | None) -> None:
        """Refuse a request its tenant's token buckets cannot take: one too big for them at
        once; one whose wait would pass `max_queue_wait`, with the wait as retry_after."""
        if request.tenant not in self.rates.buckets:
            return
        field = self.rates.exceeds(request)
        if field is not None:
            raise QuotaError.about(field, f"exceeds what tenant {request.tenant!r} may use per "
                                   f"minute ({limits.input_tokens_per_minute} input, "
                                   f"{limits.output_tokens_per_minute} output tokens)")
        if limits.max_queue_wait is None:
            return
        ahead = (tenant.queued_input, tenant.queued_output) if tenant is not None else (0, 0)
        wait = self.rates.wait(request, self.clock(), *ahead)
        if wait > limits.max_queue_wait:
            raise QuotaError.about("tenant", f"{request.tenant!r} is over its token rate: this "
                                   f"request would wait {wait:.1f} s (max_queue_wait "
                                   f"{limits.max_queue_wait})", retry_after=wait)

    def clamp_priority(self, request: Request) -> None:
        """Lower a priority above the tenant's `max_priority` to it."""
        ceiling = self.config.tenant(request.tenant).max_priority
        if ceiling is not None and request.priority > ceiling:
            request.priority = ceiling

    def may_start(self, tenant: TenantState, request: Request) -> bool:
        """Whether `request`, its tenant's next in line, may be admitted now: within the
        tenant's running cap and, for a first admission, its token buckets."""
        limit = tenant.config.max_running
        if limit is not None and tenant.running + tenant.paused >= limit:
            return False
        if request.rate_charged or request.tenant not in self.rates.buckets:
            return True  # the common case: no clock read on the scheduler's iteration
        return self.rates.affords(request, self.clock())

    def admitted(self, request: Request) -> None:
        """It left the queue for the running set: a first admission pays its tokens."""
        if request.rate_charged:
            return
        request.rate_charged = True
        self.rates.charge(request)
        tenant = self.tenants[request.tenant]
        tenant.queued_input -= len(request.prompt_token_ids)
        tenant.queued_output -= request.sampling.max_tokens

    # -- a tenant's requests --------------------------------------------------------------
    def open_request(self, name: str) -> TenantState:
        """A request of `name` was accepted: its tenant becomes active if it was idle."""
        tenant = self.tenants.get(name)
        if tenant is None:
            if name not in self.usage:
                self.usage[name] = TenantUsage()
            tenant = self.tenants[name] = TenantState(name, self.config.tenant(name), TenantUsage())
        if tenant.live == 0:
            self.on_tenant_active(tenant, [t for t in self.tenants.values() if t.live > 0])
        tenant.live += 1
        return tenant

    def queued_new(self, request: Request) -> None:
        """A new request waits for its first admission (what its buckets must pay)."""
        tenant = self.tenants[request.tenant]
        tenant.queued_input += len(request.prompt_token_ids)
        tenant.queued_output += request.sampling.max_tokens

    def request_ended(self, request: Request) -> None:
        """Settle its tokens: unused output back to the bucket, or, never admitted, out of
        its tenant's queued demand."""
        if request.rate_charged:
            self.rates.refund(request)
            return
        tenant = self.tenants[request.tenant]
        tenant.queued_input -= len(request.prompt_token_ids)
        tenant.queued_output -= request.sampling.max_tokens

    def close_request(self, name: str) -> None:
        """A request of `name` ended; the tenant's last one retires its scheduling state.

        Retiring is what keeps a flood of one-off tenant names from slowing every later step;
        the fair policy starts a returning tenant at the current minimum counter anyway, so
        the dropped virtual counter carried no credit worth keeping. What it used is added to
        its record, and for a tenant only a client named to the sum of such tenants, which
        keeps `stats()` from summing every name ever seen.
        """
        tenant = self.tenants[name]
        tenant.live -= 1
        tenant.usage.finished += 1
        if tenant.live == 0:
            del self.tenants[name]
            self.usage[name].add(tenant.usage)
            if not self.config.is_configured(name):
                self.other_usage.add(tenant.usage)

    def count_waiting(self, name: str, change: int) -> None:
        self.tenants[name].waiting += change

    def count_running(self, name: str, change: int) -> None:
        self.tenants[name].running += change

    def count_paused(self, name: str, change: int) -> None:
        self.tenants[name].paused += change

    def count_rejection(self, name: object) -> None:
        """Per tenant only for tenants already on the books: counting rejections of invented
        names would let a client grow this table with names it never gets to use."""
        if not isinstance(name, str):
            return
        if name in self.tenants:
            self.tenants[name].usage.rejected += 1
        elif name in self.usage:
            self.usage[name].rejected += 1
            if not self.config.is_configured(name):
                self.other_usage.rejected += 1

    # -- charges --------------------------------------------------------------------------
    def charge_kv(self, request: Request, now: float) -> None:
        """Add the block-seconds of the blocks held since the last change to the request's cost."""
        if request.block_ids:
            cost = len(request.held_block_ids) * (now - request.kv_since)
            request.kv_block_seconds += cost
            self.tenants[request.tenant].usage.kv_block_seconds += cost
        request.kv_since = now

    def charge_prefill(self, tenant: TenantState, fresh: int, recomputed: int) -> None:
        usage = tenant.usage
        usage.recomputed_tokens += recomputed
        usage.prefill_tokens += fresh
        charged = fresh + recomputed if self.config.charge_recompute else fresh
        charge = self.config.fair_prompt_cost * charged
        usage.service += charge
        tenant.virtual_time += charge / tenant.config.weight

    def charge_decode(self, tenant: TenantState) -> None:
        usage = tenant.usage
        cost = self.config.fair_output_cost
        usage.decode_tokens += 1
        usage.service += cost
        tenant.virtual_time += cost / tenant.config.weight

    def charge_cached(self, name: str, tokens: int) -> None:
        self.tenants[name].usage.cached_tokens += tokens

    def charge_preemption(self, name: str) -> None:
        self.tenants[name].usage.preemptions += 1

    # -- inspection -----------------------------------------------------------------------
    def tenant_usage(self, name: str) -> TenantUsage:
        """All a tenant has used so far: its record plus what it used since it became active."""
        total = TenantUsage()
        if name in self.usage:
            total.add(self.usage[name])
        if name in self.tenants:
            total.add(self.tenants[name].usage)
        return total

    def counter_problems(self, actual: dict[str, list[int]]) -> list[str]:
        """How the counters disagree with `actual` (tenant -> [live, waiting, running,
        paused])."""
        problems = []
        for name in set(actual) | set(self.tenants):
            tenant = self.tenants.get(name)
            counted = ([tenant.live, tenant.waiting, tenant.running, tenant.paused] if tenant
                       else [0, 0, 0, 0])
            if counted != actual.get(name, [0, 0, 0, 0]) or (tenant and not tenant.live):
                problems.append(
                    f"tenant {name}: counters live/waiting/running/paused {counted}, "
                    f"actual {actual.get(name, [0, 0, 0, 0])} (an idle tenant keeps no state)"
                )
        return problems

    def stats(self, queues: dict[str, Counter[str]]) -> dict[str, Any]:
        """Each configured or active tenant's limits, counters and usage; `queues` gives its
        live requests by state."""
        shown = {DEFAULT_TENANT, *self.config.tenants, *self.tenants}
        return {
            "tenants": {name: self._tenant_stats(name, queues.get(name, {})) for name in shown},
            # client-named tenants (open_tenants) that are idle, summed: one entry however
            # many names clients invented, so snapshots and metric labels stay bounded
            "other_tenants": self.other_usage.as_dict(),
        }

    def _tenant_stats(self, name: str, queues: dict[str, int]) -> dict[str, Any]:
        limits = self.config.tenant(name)
        state = self.tenants.get(name)
        return {
            "weight": limits.weight,
            # as applied: the queue cap is its own, else the default cap of every tenant
            "limits": dataclasses.replace(limits.limits(),
                                          max_queued=self.config.max_queued_of(name)),
            **self.rates.levels(name),
            # set up by the config or an operator (not only named by a client)
            "configured": self.config.is_configured(name),
            "queues": dict(queues),
            "waiting": state.waiting if state else 0,
            "running": state.running if state else 0,
            "virtual_time": state.virtual_time if state else 0.0,
            **self.tenant_usage(name).as_dict(),
        }
