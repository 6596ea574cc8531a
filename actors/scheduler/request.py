"""One request as the scheduler sees it: its tokens, progress, KV blocks, timestamps and cost.

The request object is the only place a request's progress lives, and it checks its own fields
and keeps its own counts as tokens are computed and sampled; the scheduler moves it between
states and queues, the KV cache manager owns the blocks it lists.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

from sluice.actors.scheduler.plan import RequestCost, RequestOutput
from sluice.ipc.vocabulary import FinishReason, InvalidRequestError, SamplingParams


class RequestState(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PAUSED = "paused"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def is_ended(self) -> bool:
        return self in _ENDED


_ENDED = frozenset({RequestState.FINISHED, RequestState.CANCELLED, RequestState.FAILED})

# abort reasons that do not mean the client asked for it
FAILED_REASONS = frozenset({FinishReason.ERROR})


@dataclass(slots=True, eq=False)
class Request:
    """A generation request. Callers fill the first seven fields; the scheduler owns the rest."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    tenant: str = "default"
    priority: int = 0  # higher runs first under the priority policy and is preempted last
    arrival_time: float | None = None  # scheduler clock; None means "when added"
    timeout: float | None = None  # seconds from arrival; None: its tenant's default, if any

    state: RequestState = field(default=RequestState.WAITING, init=False)
    output_token_ids: list[int] = field(default_factory=list, init=False)
    # prompt followed by output: the tokens the KV must catch up with
    all_token_ids: list[int] = field(default_factory=list, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    # its block table: entry i holds tokens i * block_size onwards; the first
    # `num_unseen_blocks` went back to the pool (no attention window sees them again, see
    # `KVCacheManager.free_unseen`) and only stand in for them, so `held_block_ids` are its own
    block_ids: list[int] = field(default_factory=list, init=False)
    num_unseen_blocks: int = field(default=0, init=False)
    # hash chain of this request's full blocks, computed as far as known
    block_hashes: list[bytes] = field(default_factory=list, init=False)
    num_cached_tokens: int = field(default=0, init=False)  # prompt tokens from the prefix cache
    num_preemptions: int = field(default=0, init=False)  # every cause
    num_priority_preemptions: int = field(default=0, init=False)  # for a higher priority
    num_recomputed_tokens: int = field(default=0, init=False)
    num_prefill_tokens: int = field(default=0, init=False)  # computed prompt-side tokens, once
    num_decode_tokens: int = field(default=0, init=False)
    kv_block_seconds: float = field(default=0.0, init=False)  # KV held over time: its memory cost
    kv_since: float = field(default=0.0, init=False)  # when block_ids last changed
    compute_seconds: float = field(default=0.0, init=False)  # its share of the steps' forwards
    # the most tokens whose KV this request ever had: computing below it again is recompute
    max_computed_tokens: int = field(default=0, init=False)
    sampling_seed: int = field(default=0, init=False)
    finish_reason: FinishReason | None = field(default=None, init=False)
    resume_state: RequestState | None = field(default=None, init=False)  # state before PAUSED
    rate_charged: bool = field(default=False, init=False)  # its tenant's buckets paid for it

    # timestamps, all from the scheduler's clock; each is the first time it got there
    queued_time: float | None = field(default=None, init=False)
    first_scheduled_time: float | None = field(default=None, init=False)
    prefill_done_time: float | None = field(default=None, init=False)
    first_token_time: float | None = field(default=None, init=False)
    last_token_time: float | None = field(default=None, init=False)
    finish_time: float | None = field(default=None, init=False)

    # bookkeeping of the core: which queue entry is current, which step last scheduled it
    queue_epoch: int = field(default=0, init=False)
    in_queue: bool = field(default=False, init=False)
    scheduled_step: int = field(default=-1, init=False)
    last_chunk_was_decode: bool = field(default=False, init=False)
    stop_ids: frozenset[int] = field(default=frozenset(), init=False)
    max_total_tokens: int = field(default=0, init=False)  # prompt + max_tokens, capped by model
    reserved_blocks: int = field(default=0, init=False)  # KV promised under reserve admission
    has_penalties: bool = field(default=False, init=False)  # plans carry the token lists

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def held_block_ids(self) -> list[int]:
        """The blocks it references: its table less the entries given back to the pool."""
        return self.block_ids[self.num_unseen_blocks:] if self.num_unseen_blocks else self.block_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.state.is_ended

    @property
    def remaining_work(self) -> int:
        """Tokens still to compute or generate: the srpt policy's job size."""
        return (len(self.all_token_ids) - self.num_computed_tokens) + (
            self.sampling.max_tokens - len(self.output_token_ids)
        )

    def wait_time(self, now: float) -> float:
        start = self.first_scheduled_time if self.first_scheduled_time is not None else now
        return start - (self.arrival_time or 0.0)

    def check_fields(self) -> None:
        """Raise `InvalidRequestError` naming the first field a caller filled in wrong."""
        rid, prompt = self.request_id, self.prompt_token_ids
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError.about("request_id", "must be a non-empty string")
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidRequestError.about("sampling", "must be SamplingParams")
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequestError.about("prompt_token_ids",
                                            "must be a non-empty list of token ids")
        if not all(isinstance(t, int) and t >= 0 for t in prompt):
            raise InvalidRequestError.about("prompt_token_ids",
                                            "every token id must be an integer >= 0")
        if not isinstance(self.priority, int):
            raise InvalidRequestError.about("priority", "must be an integer")

    def prepare(
        self, now: float, rng: random.Random, eos_token_ids: frozenset[int], max_model_len: int
    ) -> None:
        """Fill in what the scheduler derives once, when it accepts the request."""
        if self.arrival_time is None:
            self.arrival_time = now
        self.all_token_ids = list(self.prompt_token_ids)
        sampling = self.sampling
        self.sampling_seed = sampling.seed if sampling.seed is not None else rng.getrandbits(63)
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids |= eos_token_ids
        self.stop_ids = frozenset(stop_ids)
        self.has_penalties = sampling.has_penalties
        self.max_total_tokens = min(len(self.prompt_token_ids) + sampling.max_tokens, max_model_len)
        self.state = RequestState.WAITING
        self.queued_time = now

    def computed(self, start: int, end: int) -> int:
        """Its KV holds tokens `start:end` now; returns how many of them it computed before
        (recompute after a preemption), counting a prefill chunk's tokens once."""
        recomputed = 0
        if not self.last_chunk_was_decode:
            recomputed = max(0, min(end, self.max_computed_tokens) - start)
            self.num_recomputed_tokens += recomputed
            self.num_prefill_tokens += end - start - recomputed
        if end > self.num_computed_tokens:
            self.num_computed_tokens = end
        if end > self.max_computed_tokens:
            self.max_computed_tokens = end
        return recomputed

    def sampled(self, token_id: int, now: float, max_model_len: int) -> FinishReason | None:
        """Append a sampled token; the finish reason it brings (STOP, LENGTH) or None."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.num_decode_tokens += 1
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        if token_id in self.stop_ids:
            return FinishReason.STOP
        if len(self.output_token_ids) >= self.sampling.max_tokens or (
            len(self.all_token_ids) >= max_model_len
        ):
            return FinishReason.LENGTH
        return None

    def ended(self, reason: FinishReason, state: RequestState, now: float,
              error: str = "", *, configured: bool = False) -> RequestOutput:
        """Record how it ended; the output that reports it, with its usage and cost."""
        self.state = state
        self.finish_reason = reason
        self.finish_time = now
        cost = RequestCost(self.tenant, configured, self.queued_time or 0.0,
                           self.first_scheduled_time or 0.0, self.prefill_done_time or 0.0, now,
                           self.kv_block_seconds, self.compute_seconds, self.num_preemptions)
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=[],
            finished=True,
            finish_reason=reason,
            error=error,
            prompt_tokens=len(self.prompt_token_ids),
            cached_tokens=self.num_cached_tokens,
            preemptions=self.num_preemptions,
            recomputed_tokens=self.num_recomputed_tokens,
            cost=cost,
        )
