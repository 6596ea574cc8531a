"""Scheduling policies: which waiting request is admitted next, and in which order prefills run.

A policy is an object over the same core. It gives each request a static sort key inside its
tenant, and picks which tenant goes next. Aging (a request that has waited `max_wait` goes
first) lives in the wait queue, so every policy gets it. The per-tenant service and virtual
counters the fair policy decides by are kept by the tenant ledger (`tenant_ledger.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.actors.scheduler.config import SchedulerConfig
from sluice.actors.scheduler.request import Request
from sluice.actors.scheduler.tenant_ledger import TenantState


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
    """Weighted fair sharing between tenants by virtual token counters; inside a tenant,
    higher `priority` first, then arrival."""

    name = "fair"

    def key(self, request: Request) -> tuple:
        return (-request.priority, request.arrival_time, request.request_id)

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
