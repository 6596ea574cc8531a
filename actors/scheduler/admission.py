"""Admission: validating and queueing requests, and moving the policy's pick into the running set.

`add_request` turns a request into a typed rejection or a queue entry (a tenant nobody created
is rejected before it costs a table entry); `_admit` (called while planning) takes prefix-cache
hits, whose hash chain starts from the tenant's salt, checks the KV watermarks and the
reservation, and gives the request its first chunk. Mixed into `Scheduler` (`core.py`), which
owns the tables used here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sluice.actors.scheduler.block_manager import hash_block
from sluice.actors.scheduler.errors import InvalidRequest, Overloaded, Quota, TooLong
from sluice.actors.scheduler.plan import SamplingParams
from sluice.actors.scheduler.policy import TenantState
from sluice.actors.scheduler.request import Request, RequestState

if TYPE_CHECKING:
    from sluice.actors.scheduler.core import Scheduler

WAITING, PREFILLING = RequestState.WAITING, RequestState.PREFILLING


class AdmissionMixin:
    # -- admission ------------------------------------------------------------------------
    def add_request(self: Scheduler, request: Request) -> None:
        """Queue a request, or raise `Rejected` (invalid, too_long, quota, overloaded)."""
        try:
            self._validate(request)
        except Exception:
            self.num_rejected += 1
            # per tenant only for tenants already on the books: counting rejections of
            # invented names would let a client grow this table with names it never gets to use
            name = request.tenant if isinstance(request.tenant, str) else ""
            if name in self.tenants:
                self.tenants[name].usage.rejected += 1
            elif name in self.usage:
                self.usage[name].rejected += 1
                if not self.config.is_configured(name):
                    self.other_usage.rejected += 1
            raise
        now = self.clock()
        if request.arrival_time is None:
            request.arrival_time = now
        request.all_token_ids = list(request.prompt_token_ids)
        sampling = request.sampling
        request.sampling_seed = (
            sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
        )
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids |= self.eos_token_ids
        request.stop_ids = frozenset(stop_ids)
        request.has_penalties = sampling.has_penalties
        request.max_total_tokens = min(
            len(request.prompt_token_ids) + sampling.max_tokens, self.max_model_len
        )
        request.state = WAITING
        request.queued_time = now
        self.requests[request.request_id] = request
        tenant = self._tenant(request.tenant)
        self._activate(tenant)
        self._enqueue(request)

    def _validate(self: Scheduler, request: Request) -> None:
        rid = request.request_id
        if not isinstance(rid, str) or not rid:
            raise InvalidRequest("request_id: must be a non-empty string")
        if rid in self.requests:
            raise InvalidRequest(f"request_id: {rid!r} is already in use")
        if not isinstance(request.sampling, SamplingParams):
            raise InvalidRequest("sampling: must be SamplingParams")
        prompt = request.prompt_token_ids
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequest("prompt_token_ids: must be a non-empty list of token ids")
        if not all(isinstance(t, int) and t >= 0 for t in prompt):
            raise InvalidRequest("prompt_token_ids: every token id must be an integer >= 0")
        if not isinstance(request.priority, int):
            raise InvalidRequest("priority: must be an integer")
        if not isinstance(request.tenant, str) or not self.config.tenant_exists(request.tenant):
            # before any other tenant check, so an invented name costs no table entry
            raise InvalidRequest(
                f"tenant: {request.tenant!r} is not a tenant here (an operator creates tenants)"
            )
        n = len(prompt)
        if n + 1 > self.max_model_len:
            raise TooLong(
                f"prompt_token_ids: {n} tokens leave no room to generate "
                f"within max_model_len {self.max_model_len}"
            )
        bm = self.block_manager
        if bm.blocks_for(n + 1) > bm.num_total_blocks:
            raise TooLong(
                f"prompt_token_ids: {n} tokens do not fit the KV pool "
                f"({bm.num_total_blocks * bm.block_size} tokens)"
            )
        # a request must be able to finish alone, or it would be preempted forever
        total = min(n + request.sampling.max_tokens, self.max_model_len)
        if bm.blocks_for(total) > bm.num_total_blocks:
            raise TooLong(
                f"max_tokens: prompt + max_tokens = {total} tokens do not fit "
                f"the KV pool ({bm.num_total_blocks * bm.block_size} tokens)"
            )
        limits = self.config.tenant(request.tenant)
        if (
            limits.max_new_tokens is not None
            and request.sampling.max_tokens > limits.max_new_tokens
        ):
            raise Quota(
                f"max_tokens: tenant {request.tenant!r} allows at most {limits.max_new_tokens}, "
                f"got {request.sampling.max_tokens}"
            )
        if limits.max_context is not None and n + request.sampling.max_tokens > limits.max_context:
            raise Quota(
                f"prompt_token_ids: prompt + max_tokens = {n + request.sampling.max_tokens} "
                f"exceeds tenant {request.tenant!r}'s max_context {limits.max_context}"
            )
        tenant = self.tenants.get(request.tenant)
        queued = tenant.waiting if tenant is not None else 0  # no state yet: nothing queued
        max_queued = self.config.max_queued_of(request.tenant)
        if max_queued is not None and queued >= max_queued:
            raise Quota(
                f"tenant: {request.tenant!r} already has {queued} requests queued "
                f"(max_queued {max_queued})"
            )
        if len(self.waiting) >= self.config.max_queued:
            raise Overloaded(f"queue: {len(self.waiting)} requests are already waiting")

    def _admit(self: Scheduler, request: Request, now: float) -> bool:
        """Move the policy's pick from the queue into the running set with its first chunk."""
        bm = self.block_manager
        cfg = self.config
        if cfg.admission == "reserve":
            need = bm.blocks_for(request.max_total_tokens)
            if self._reserved_blocks + need > bm.num_total_blocks:
                return False
        hits = self._match_prefix(request)
        for block in hits:
            bm.acquire_cached(block)
        start = len(hits) * bm.block_size
        if not bm.can_allocate(bm.blocks_for(start + 1) - len(hits)):
            bm.free(hits)
            return False
        self.waiting.remove(request)
        tenant = self.tenants[request.tenant]
        tenant.waiting -= 1
        tenant.running += 1
        if cfg.admission == "reserve":
            request.reserved_blocks = bm.blocks_for(request.max_total_tokens)
            self._reserved_blocks += request.reserved_blocks
        request.kv_since = self.clock()
        request.block_ids = hits
        request.num_computed_tokens = start
        if request.max_computed_tokens == 0:
            request.num_cached_tokens = start
            tenant.usage.cached_tokens += start
        request.state = PREFILLING
        self.running[request.request_id] = request
        self.prefilling[request.request_id] = request
        self._schedule_chunk(request, may_preempt=False)
        return True

    def _match_prefix(self: Scheduler, request: Request) -> list[int]:
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return []
        hits = []
        for index in range((len(request.all_token_ids) - 1) // bm.block_size):
            bm.cache_queries += 1
            block = bm.lookup(self._block_hash(request, index))
            if block is None:
                break
            bm.cache_hits += 1
            hits.append(block)
        return hits

    def _block_hash(self: Scheduler, request: Request, index: int) -> bytes:
        hashes = request.block_hashes
        size = self.block_manager.block_size
        tokens = request.all_token_ids
        while len(hashes) <= index:
            j = len(hashes)
            parent = hashes[j - 1] if j else self._prefix_salt(request.tenant)
            hashes.append(hash_block(parent, tokens[j * size : (j + 1) * size]))
        return hashes[index]

    def _prefix_salt(self: Scheduler, tenant: str) -> bytes:
        """Where a tenant's hash chain starts: its own salt unless it opted in to sharing.

        With a salt per tenant, one tenant's prompt never matches blocks another tenant
        computed, so `cached_tokens` cannot tell a tenant what others sent.
        """
        limits = self.config.tenant(tenant)
        if limits.prefix_cache_group is not None:
            return b"group:" + limits.prefix_cache_group.encode()
        if limits.share_prefix_cache:
            return b"shared"
        return b"tenant:" + tenant.encode("utf-8", "surrogatepass")

    def _admission_allowed(self: Scheduler) -> bool:
        usage = self.block_manager.usage
        cfg = self.config
        if self._admission_open and usage >= cfg.kv_high_watermark and self.running:
            self._admission_open = False
        elif not self._admission_open and (usage < cfg.kv_low_watermark or not self.running):
            self._admission_open = True
        return self._admission_open

    def _tenant_may_run(self: Scheduler, tenant: TenantState) -> bool:
        limit = tenant.config.max_running
        return limit is None or tenant.running < limit
