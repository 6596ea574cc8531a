"""The request table: where each live request is, and the moves between those places.

A live request is in exactly one place that matches its state: the wait queue (waiting or
preempted), `running` (prefilling or decoding; `prefilling` is its prefilling subset) or
`paused`. Each move here changes the place, the state and the tenant ledger's waiting,
running and paused counters together, so they cannot drift apart. Ended requests leave the
table and are kept a while in `recently_ended` for inspection. Which move happens when, and what happens to
a request's KV, is the scheduler's (`scheduler.py`).
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from sluice.actors.scheduler.policy import Policy
from sluice.actors.scheduler.request import Request, RequestState
from sluice.actors.scheduler.tenant_ledger import TenantLedger
from sluice.actors.scheduler.wait_queue import WaitQueue
from sluice.ipc.vocabulary import FinishReason

WAITING, PREFILLING, DECODING = RequestState.WAITING, RequestState.PREFILLING, RequestState.DECODING
PAUSED, PREEMPTED = RequestState.PAUSED, RequestState.PREEMPTED
_RECENT_LIMIT = 1024


class RequestTable:
    def __init__(self, policy: Policy, max_wait: float, ledger: TenantLedger):
        self.ledger = ledger
        self.waiting = WaitQueue(policy, max_wait)
        self.running: dict[str, Request] = {}  # prefilling and decoding, in admission order
        self.prefilling: dict[str, Request] = {}  # the prefilling subset of `running`
        self.paused: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}  # every request not yet ended
        self.recently_ended: OrderedDict[str, Request] = OrderedDict()
        self.ended_by_reason: dict[FinishReason, int] = {}

    def get(self, request_id: str) -> Request | None:
        """A live request, or one of the recently ended ones."""
        return self.requests.get(request_id) or self.recently_ended.get(request_id)

    def add(self, request: Request) -> None:
        """A new request: into the table and the wait queue."""
        self.requests[request.request_id] = request
        self.ledger.open_request(request.tenant)
        self.enqueue(request)

    def enqueue(self, request: Request) -> None:
        self.waiting.push(request)
        self.ledger.count_waiting(request.tenant, 1)

    def leave(self, request: Request) -> None:
        """Take a request out of whichever place holds it (not out of the table)."""
        rid = request.request_id
        if request.in_queue:
            self.waiting.remove(request)
            self.ledger.count_waiting(request.tenant, -1)
        elif request.state is PAUSED:
            if self.paused.pop(rid, None) is not None:
                self.ledger.count_paused(request.tenant, -1)
        elif rid in self.running:
            del self.running[rid]
            self.prefilling.pop(rid, None)
            self.ledger.count_running(request.tenant, -1)

    def start_prefill(self, request: Request) -> None:
        """From the wait queue into the running set."""
        self.waiting.remove(request)
        self.ledger.count_waiting(request.tenant, -1)
        self.ledger.count_running(request.tenant, 1)
        request.state = PREFILLING
        self.running[request.request_id] = request
        self.prefilling[request.request_id] = request

    def prefill_done(self, request: Request, now: float) -> None:
        """Its prompt is computed: it decodes from now on (after its pause, if paused)."""
        if request.state is PREFILLING:
            request.state = DECODING
            self.prefilling.pop(request.request_id, None)
        elif request.state is PAUSED and request.resume_state is PREFILLING:
            request.resume_state = DECODING
        else:
            return
        if request.prefill_done_time is None:  # the first time: a recompute does not move it
            request.prefill_done_time = now

    def pause(self, request: Request) -> None:
        self.leave(request)
        request.resume_state = request.state
        request.state = PAUSED
        self.paused[request.request_id] = request
        self.ledger.count_paused(request.tenant, 1)

    def resume(self, request: Request) -> None:
        """Back to the place it was paused from; a request preempted meanwhile queues."""
        rid = request.request_id
        del self.paused[rid]
        self.ledger.count_paused(request.tenant, -1)
        state = request.resume_state or WAITING
        request.resume_state = None
        request.state = state
        if state in (PREFILLING, DECODING):
            self.running[rid] = request
            self.ledger.count_running(request.tenant, 1)
            if state is PREFILLING:
                self.prefilling[rid] = request
        else:
            self.enqueue(request)

    def requeue(self, request: Request) -> None:
        """It lost its KV: back to the queue to recompute, or, if paused, when it resumes."""
        if request.state is PAUSED:
            request.resume_state = PREEMPTED
            return
        self.leave(request)
        request.state = PREEMPTED
        self.enqueue(request)

    def remove(self, request: Request, reason: FinishReason) -> None:
        """It ended: out of its place and the table, kept a while among the recently ended."""
        self.leave(request)
        rid = request.request_id
        del self.requests[rid]
        self.ledger.close_request(request.tenant)
        self.ended_by_reason[reason] = self.ended_by_reason.get(reason, 0) + 1
        self.recently_ended[rid] = request
        if len(self.recently_ended) > _RECENT_LIMIT:
            self.recently_ended.popitem(last=False)

    def counts(self) -> tuple[dict[str, int], dict[str, Counter[str]]]:
        """Live requests by state, overall and per tenant."""
        by_state: Counter[str] = Counter()
        per_tenant: dict[str, Counter[str]] = {}
        for request in self.requests.values():
            by_state[request.state.value] += 1
            per_tenant.setdefault(request.tenant, Counter())[request.state.value] += 1
        queues = {s.value: by_state.get(s.value, 0) for s in RequestState if not s.is_ended}
        return queues, per_tenant
