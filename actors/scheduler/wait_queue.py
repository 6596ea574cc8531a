"""The queue of requests waiting for admission (new ones and preempted ones).

One heap per tenant, ordered by the policy's key, plus one heap by arrival for aging. Removal
is lazy: a request's `queue_epoch` changes when it leaves, which makes its old entries stale;
stale entries are dropped when they reach a heap's top, and a heap that holds more stale
entries than live ones is rebuilt. A tenant has a heap only while it has a request queued, so
picking the next request costs O(tenants with queued requests + log n), however many tenant
names have ever been seen, and never a scan of the queue.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator

from sluice.actors.scheduler.policy import Policy
from sluice.actors.scheduler.request import Request
from sluice.actors.scheduler.tenant_ledger import TenantState

_Entry = tuple  # (key, tie-breaker, epoch, request)


class WaitQueue:
    def __init__(self, policy: Policy, max_wait: float):
        self.policy = policy
        self.max_wait = max_wait
        self._heaps: dict[str, list[_Entry]] = {}  # only tenants with a request queued
        self._queued: dict[str, int] = {}  # queued requests per tenant, same keys as _heaps
        self._by_arrival: list[_Entry] = []
        self._tie = itertools.count()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, request: Request) -> bool:
        return request.in_queue

    def push(self, request: Request) -> None:
        if request.in_queue:
            raise AssertionError(f"request {request.request_id} queued twice")
        request.queue_epoch += 1
        request.in_queue = True
        tie = next(self._tie)
        heap = self._heaps.setdefault(request.tenant, [])
        self._queued[request.tenant] = self._queued.get(request.tenant, 0) + 1
        heapq.heappush(heap, (self.policy.key(request), tie, request.queue_epoch, request))
        if self.max_wait != float("inf"):
            heapq.heappush(
                self._by_arrival, (request.arrival_time, tie, request.queue_epoch, request)
            )
        self._size += 1

    def remove(self, request: Request) -> None:
        if not request.in_queue:
            raise AssertionError(f"request {request.request_id} is not queued")
        request.in_queue = False
        request.queue_epoch += 1
        self._size -= 1
        tenant = request.tenant
        left = self._queued[tenant] - 1
        if left == 0:  # the tenant's last queued request: its heap holds only stale entries
            del self._queued[tenant], self._heaps[tenant]
        else:
            self._queued[tenant] = left
            heap = self._heaps[tenant]
            if len(heap) > 2 * left + 16:
                self._heaps[tenant] = self._live_entries(heap)
        if len(self._by_arrival) > 2 * self._size + 16:
            self._by_arrival = self._live_entries(self._by_arrival)

    @property
    def tenants(self) -> frozenset[str]:
        """Tenants with at least one request queued (the ones the queue keeps a heap for)."""
        return frozenset(self._heaps)

    @staticmethod
    def _live_entries(heap: list[_Entry]) -> list[_Entry]:
        """A heap without its stale entries: stale ones otherwise pile up under a live top."""
        live = [e for e in heap if e[3].in_queue and e[3].queue_epoch == e[2]]
        heapq.heapify(live)
        return live

    def select(
        self,
        now: float,
        tenants: dict[str, TenantState],
        eligible: Callable[[TenantState, Request], bool],
        iteration_seconds: float = 0.0,
    ) -> Request | None:
        """The request to admit next (left in the queue), or None when nobody eligible waits.

        A request that would pass `max_wait` by waiting one more iteration goes first. A
        tenant whose next request is not `eligible` (a cap, its token rate) is passed over.
        """
        if self._size == 0:
            return None
        overdue = self._top(self._by_arrival)
        if overdue is not None and now + iteration_seconds - overdue.arrival_time >= self.max_wait:
            if eligible(tenants[overdue.tenant], overdue):
                return overdue
        tops = []
        for name, heap in self._heaps.items():
            tenant = tenants[name]
            if tenant.waiting:
                top = self._top_entry(heap)
                if top is not None and eligible(tenant, top[3]):
                    tops.append((tenant, top[0]))
        if not tops:
            return None
        tenant = self.policy.pick_tenant(tops)
        return self._top_entry(self._heaps[tenant.name])[3]

    def requests(self) -> Iterator[Request]:
        """Every queued request, in no particular order (for checks and snapshots)."""
        seen = set()
        for heap in self._heaps.values():
            for _, _, epoch, request in heap:
                if request.in_queue and request.queue_epoch == epoch and id(request) not in seen:
                    seen.add(id(request))
                    yield request

    def _top(self, heap: list[_Entry]) -> Request | None:
        entry = self._top_entry(heap)
        return None if entry is None else entry[3]

    @staticmethod
    def _top_entry(heap: list[_Entry]) -> _Entry | None:
        while heap:
            entry = heap[0]
            request = entry[3]
            if request.in_queue and request.queue_epoch == entry[2]:
                return entry
            heapq.heappop(heap)
        return None
