"""What a tenant may take over time and how long a request may live: token buckets, KV caps and
deadlines.

`TenantRates` holds each rate-limited tenant's input and output token buckets (one minute's
tokens, refilled continuously, kept for named tenants only); `KVCaps` counts the blocks a
tenant's requests hold against its `max_kv_blocks`; `Deadlines` hands out, in order, the requests
whose timeout passed. The rules a request meets are in docs/configuration.md,
"[scheduler.tenants.NAME]".
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from sluice.actors.scheduler.config import TenantConfig
from sluice.actors.scheduler.request import Request
from sluice.ipc.vocabulary import QuotaError


@dataclass(slots=True)
class TokenBucket:
    per_minute: float
    level: float  # tokens there now (after the last refill)
    refilled: float  # clock time of the last refill

    @property
    def capacity(self) -> float:
        return self.per_minute

    def refill(self, now: float) -> None:
        if now > self.refilled:
            self.level = min(self.capacity, self.level + (now - self.refilled) * self.per_minute / 60)
        self.refilled = max(self.refilled, now)

    def wait_for(self, tokens: float, now: float, ahead: float = 0.0) -> float:
        """Seconds until `tokens` are there after `ahead` were taken (0.0: now); inf for more
        than the bucket ever holds."""
        if tokens > self.capacity:
            return math.inf
        self.refill(now)
        missing = ahead + tokens - self.level
        return 0.0 if missing <= 0 else missing * 60 / self.per_minute

    def take(self, tokens: float) -> None:
        self.level -= tokens

    def give_back(self, tokens: float) -> None:
        self.level = min(self.capacity, self.level + tokens)


class TenantRates:
    """The input and output token buckets of every tenant that has rates."""

    def __init__(self) -> None:
        self.buckets: dict[str, tuple[TokenBucket | None, TokenBucket | None]] = {}

    def configure(self, name: str, config: TenantConfig, now: float) -> None:
        """(Re)make a tenant's buckets for new rates; an unchanged rate keeps its level."""
        old = self.buckets.pop(name, (None, None))
        rates = (config.input_tokens_per_minute, config.output_tokens_per_minute)
        if rates == (None, None):
            return
        self.buckets[name] = tuple(
            None if rate is None
            else bucket if bucket is not None and bucket.per_minute == rate
            else TokenBucket(float(rate), float(rate), now)
            for rate, bucket in zip(rates, old, strict=True))

    def wait(self, request: Request, now: float, queued_input: int = 0,
             queued_output: int = 0) -> float:
        """Seconds until the request's tokens, after `queued_*` ahead of it, are there."""
        input_bucket, output_bucket = self.buckets.get(request.tenant, (None, None))
        wait = 0.0
        if input_bucket is not None:
            wait = input_bucket.wait_for(len(request.prompt_token_ids), now, queued_input)
        if output_bucket is not None:
            wait = max(wait, output_bucket.wait_for(request.sampling.max_tokens, now,
                                                    queued_output))
        return wait

    def exceeds(self, request: Request) -> str | None:
        """The field of a request too big for its tenant's buckets however long it waits."""
        input_bucket, output_bucket = self.buckets.get(request.tenant, (None, None))
        if input_bucket is not None and len(request.prompt_token_ids) > input_bucket.capacity:
            return "prompt"
        if output_bucket is not None and request.sampling.max_tokens > output_bucket.capacity:
            return "max_tokens"
        return None

    def affords(self, request: Request, now: float) -> bool:
        return self.wait(request, now) == 0.0

    def charge(self, request: Request) -> None:
        """Take the request's prompt and max_tokens (at its first admission)."""
        input_bucket, output_bucket = self.buckets.get(request.tenant, (None, None))
        if input_bucket is not None:
            input_bucket.take(len(request.prompt_token_ids))
        if output_bucket is not None:
            output_bucket.take(request.sampling.max_tokens)

    def refund(self, request: Request) -> None:
        """Give back the output a request was charged for and did not generate."""
        output_bucket = self.buckets.get(request.tenant, (None, None))[1]
        if output_bucket is not None:
            output_bucket.give_back(max(0, request.sampling.max_tokens
                                        - len(request.output_token_ids)))

    def levels(self, name: str) -> dict[str, float | None]:
        input_bucket, output_bucket = self.buckets.get(name, (None, None))
        return {"input_tokens_available": None if input_bucket is None else input_bucket.level,
                "output_tokens_available": None if output_bucket is None else output_bucket.level}


class KVCaps:
    """Each tenant's `max_kv_blocks`, over the live requests of the scheduler's table."""

    def __init__(self, requests: dict[str, Request], limits: Callable[[str], TenantConfig],
                 blocks_for: Callable[[int], int]):
        self.requests = requests
        self.limits = limits
        self.blocks_for = blocks_for

    def check(self, request: Request) -> None:
        """Refuse a request that alone needs more than its tenant's cap: it could never end."""
        cap = self.limits(request.tenant).max_kv_blocks
        tokens = len(request.prompt_token_ids) + request.sampling.max_tokens
        if cap is not None and self.blocks_for(tokens) > cap:
            raise QuotaError.about("max_tokens", f"prompt + max_tokens need more KV blocks than "
                                   f"tenant {request.tenant!r}'s max_kv_blocks {cap}")

    def room(self, name: str) -> int | None:
        """Blocks the tenant may still take (None: no cap)."""
        cap = self.limits(name).max_kv_blocks
        if cap is None:
            return None
        return cap - sum(len(r.held_block_ids) for r in self.requests.values()
                         if r.tenant == name)

    def fits_prompt(self, request: Request) -> bool:
        room = self.room(request.tenant)
        return room is None or self.blocks_for(len(request.all_token_ids)) <= room

    def make_way(self, request: Request) -> Request | None:
        """The request to preempt so that `request` may take one more block (the tenant's
        youngest holding KV, perhaps itself), or None when there is room."""
        room = self.room(request.tenant)
        if room is None or room >= 1:
            return None
        own = [r for r in self.requests.values() if r.tenant == request.tenant and r.block_ids]
        return max(own, key=lambda r: (r.arrival_time, r.request_id), default=None)


class Deadlines:
    """Requests by deadline; an entry of a request that ended meanwhile is skipped."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Request]] = []
        self._tie = itertools.count()

    def watch(self, request: Request, tenant_timeout: float | None, live: int) -> None:
        """Give a new request its deadline, if it or its tenant has a timeout."""
        timeout = request.timeout if request.timeout is not None else tenant_timeout
        if timeout is not None:
            self.add(request, request.arrival_time + timeout, live)

    def add(self, request: Request, deadline: float, live: int) -> None:
        """Add one; `live` is how many requests are live, so entries of ended ones, left
        until their deadline would pass, are cleared out before they outnumber them."""
        heapq.heappush(self._heap, (deadline, next(self._tie), request))
        if len(self._heap) > 2 * live + 64:
            self._heap = [entry for entry in self._heap if not entry[2].state.is_ended]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def next_deadline(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def expired(self, now: float) -> list[Request]:
        """The requests whose deadline is at or before `now` (ended ones included: the
        caller skips them), removed from the heap."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            out.append(heapq.heappop(self._heap)[2])
        return out
