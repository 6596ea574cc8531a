"""One request as the scheduler sees it: its tokens, progress, KV blocks, timestamps and cost.

The request object is the only place a request's progress lives; the scheduler core moves it
between states and queues, the block manager owns the blocks it lists.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sluice.actors.scheduler.plan import SamplingParams


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
FAILED_REASONS = frozenset({"error"})


@dataclass(slots=True, eq=False)
class Request:
    """A generation request. Callers fill the first six fields; the scheduler owns the rest."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    tenant: str = "default"
    priority: int = 0  # higher runs first under the priority policy and is preempted last
    arrival_time: float | None = None  # scheduler clock; None means "when added"

    state: RequestState = field(default=RequestState.WAITING, init=False)
    output_token_ids: list[int] = field(default_factory=list, init=False)
    # prompt followed by output: the tokens the KV must catch up with
    all_token_ids: list[int] = field(default_factory=list, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    block_ids: list[int] = field(default_factory=list, init=False)
    # hash chain of this request's full blocks, computed as far as known
    block_hashes: list[bytes] = field(default_factory=list, init=False)
    num_cached_tokens: int = field(default=0, init=False)  # prompt tokens from the prefix cache
    num_preemptions: int = field(default=0, init=False)
    num_recomputed_tokens: int = field(default=0, init=False)
    num_prefill_tokens: int = field(default=0, init=False)  # computed prompt-side tokens, once
    num_decode_tokens: int = field(default=0, init=False)
    kv_block_seconds: float = field(default=0.0, init=False)  # KV held over time: its memory cost
    kv_since: float = field(default=0.0, init=False)  # when block_ids last changed
    # the most tokens whose KV this request ever had: computing below it again is recompute
    max_computed_tokens: int = field(default=0, init=False)
    sampling_seed: int = field(default=0, init=False)
    finish_reason: str | None = field(default=None, init=False)
    resume_state: RequestState | None = field(default=None, init=False)  # state before PAUSED

    # timestamps, all from the scheduler's clock
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
