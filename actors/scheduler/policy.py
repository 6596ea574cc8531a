"""Scheduling policies: which waiting request is admitted next, and in which order prefills run.

A policy is an object over the same core. It gives each request a static sort key inside its
tenant, and picks which tenant goes next. Aging (a request that has waited `max_wait` goes
first) lives in the wait queue, so every policy gets it. Per-tenant accounting (service,
virtual counters) lives here too because the fair policy decides by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sluice.actors.scheduler.config import SchedulerConfig, TenantConfig
from sluice.actors.scheduler.request import Request


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


class Policy:
    """Base: first come, first served."""

    name = "fcfs"

    def __init__(self, config: SchedulerConfig):
        self.config = config

    def key(self, request: Request) -> tuple:
        """Order inside one tenant's queue (smallest first); computed when queued."""
        return (request.arrival_time, request.request_id)

    def pick_tenant(self, tops: Sequence[tuple[TenantState, tuple]]) -> TenantState:
        """Choose among tenants that have an eligible request; `tops` pairs each with its key."""
        return min(tops, key=lambda item: item[1])[0]

    def prefill_order(
        self, requests: list[Request], tenants: dict[str, TenantState]
    ) -> list[Request]:
        """Order of the requests already prefilling, for this iteration's budget."""
        if len(requests) < 2:
            return requests
        return sorted(requests, key=self.key)

    def on_tenant_active(self, tenant: TenantState, active: Sequence[TenantState]) -> None:
        """A tenant with no live requests got one."""


class PriorityPolicy(Policy):
    """Higher `priority` first, then arrival; aging in the queue bounds the wait of low ones."""

    name = "priority"

    def key(self, request: Request) -> tuple:
        return (-request.priority, request.arrival_time, request.request_id)


class SrptPolicy(Policy):
    """Shortest remaining work first (tokens to compute plus tokens to generate)."""

    name = "srpt"

    def key(self, request: Request) -> tuple:
        return (request.remaining_work, request.arrival_time, request.request_id)


class FairPolicy(Policy):
    """Weighted fair sharing between tenants by virtual token counters; FCFS inside a tenant."""

    name = "fair"

    def pick_tenant(self, tops: Sequence[tuple[TenantState, tuple]]) -> TenantState:
        return min(tops, key=lambda item: (item[0].virtual_time, item[1]))[0]

    def prefill_order(
        self, requests: list[Request], tenants: dict[str, TenantState]
    ) -> list[Request]:
        if len(requests) < 2:
            return requests
        return sorted(requests, key=lambda r: (tenants[r.tenant].virtual_time, self.key(r)))

    def on_tenant_active(self, tenant: TenantState, active: Sequence[TenantState]) -> None:
        # a newcomer neither inherits credit from its idle time nor pays for old service
        others = [t.virtual_time for t in active if t is not tenant]
        if others:
            tenant.virtual_time = max(tenant.virtual_time, min(others))


POLICY_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Policy, PriorityPolicy, SrptPolicy, FairPolicy)
}


def make_policy(config: SchedulerConfig) -> Policy:
    return POLICY_CLASSES[config.policy](config)


def preemption_key(request: Request) -> tuple:
    """Larger means preempted sooner: lowest priority, then latest arrival."""
    return (-request.priority, request.arrival_time, request.request_id)
