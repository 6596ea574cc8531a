"""The data that crosses the line between planning and executing.

The scheduler core produces a `StepPlan`; whoever executes it (the in-process model runner,
the worker process, or the simulator) answers with a `StepResult`; the core turns that into
the step's `StepOutputs`. Everything here is plain data: no torch, no sockets, so it can be
msgpack-encoded for the worker process and used by the simulator without a model.

The bulky types have a compact `to_plain()` form (nested lists of msgpack's own types) and a
`from_plain()` that trusts it: a step of 256 sequences crosses a socket every few
milliseconds, and one msgpack object per sequence and per parameter set would cost more than
the scheduling itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from sluice.ipc.vocabulary import FinishReason, SamplingParams

__all__ = ["RequestCost", "RequestOutput", "SampledToken", "ScheduledSeq", "StepOutputs",
           "StepPlan", "StepResult"]


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: a prefill chunk or a single decode token.

    `token_ids` are the tokens whose KV this step computes; they sit at positions
    `start_pos .. start_pos + len(token_ids) - 1`. `block_table` covers at least
    `start_pos + len(token_ids)` tokens. When `sample` is true the chunk ends at the
    sequence's last known token and the executor samples the next one.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    sampling: SamplingParams
    # index of the output token being sampled (0 for the first); seeds per-token noise so a
    # seeded request draws the same tokens alone, in a batch, or after recompute
    num_generated: int = 0
    sampling_seed: int = 0  # the request's seed, or one the core drew for an unseeded one
    # only for a sequence that samples with a grammar or penalties (else None): the end of its
    # output, from index `num_generated - len(output_token_ids)` on (its last id, or all of
    # them where the worker may lack them: see `MATCHER_STEPS`), and with all of them its
    # prompt's ids when it has a repetition penalty (else None: the worker has them)
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None


# The worker keeps what a request's ids made of it: the grammar matcher of a constrained
# request, which takes each token it samples, and the prompt and output ids of one with
# penalties (`sampler.PenaltyIds`). A decode planned within this many steps of the request's
# previous plan carries only its last output id (the worker has the others), so a long output
# is not sent whole every step; a prefill (a recompute after a preemption or a lost worker) or
# a request last planned longer ago (the worker may have dropped what it kept: it keeps an
# idle one's for `grammar.Constraints.idle_steps` or `PenaltyIds.idle_steps` of its steps,
# more than this) carries them all, and the prompt's ids where a repetition penalty needs them.
MATCHER_STEPS = 32


@dataclass
class StepPlan:
    step_id: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    # grammars for the worker to build beside its steps, [id, kind, text] each: a constrained
    # request is admitted once the worker reported its grammar's id built (`grammar_gate`)
    grammars: list[list] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def prefill_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs if not _is_decode(s))

    @property
    def decode_tokens(self) -> int:
        return sum(1 for s in self.seqs if _is_decode(s))

    def to_plain(self) -> list:
        index: dict[tuple, int] = {}  # equal parameter sets are sent once per step
        seqs = [
            [s.request_id, s.token_ids, s.start_pos, s.block_table, s.sample,
             index.setdefault(s.sampling.plain, len(index)), s.num_generated, s.sampling_seed,
             s.prompt_token_ids, s.output_token_ids]
            for s in self.seqs
        ]  # fmt: skip
        return [self.step_id, list(index), seqs, self.grammars]

    @classmethod
    def from_plain(cls, plain: list | tuple) -> StepPlan:
        step_id, samplings, seqs, grammars = plain
        params = [SamplingParams.from_plain(p) for p in samplings]
        return cls(step_id, [
            ScheduledSeq(rid, list(tokens), start, list(table), sample, params[index], generated,
                         seed, None if prompt is None else list(prompt),
                         None if output is None else list(output))
            for rid, tokens, start, table, sample, index, generated, seed, prompt, output in seqs
        ], [list(grammar) for grammar in grammars])  # fmt: skip


def _is_decode(seq: ScheduledSeq) -> bool:
    return len(seq.token_ids) == 1 and seq.num_generated > 0


class SampledToken(NamedTuple):
    """A sampled token with the log-probabilities its request asked for. Only such requests
    get one; every other sampled token travels as its id alone."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None

    def to_plain(self) -> tuple:
        return self

    @classmethod
    def from_plain(cls, plain: list | tuple) -> SampledToken:
        token, logprob, top = plain
        return cls(token, logprob, [tuple(pair) for pair in top] if top else None)


@dataclass
class StepResult:
    step_id: int
    # the token id sampled for each scheduled sequence whose `sample` was true
    sampled: dict[str, int] = field(default_factory=dict)
    forward_seconds: float = 0.0
    # the tokens of the requests that asked for logprobs, with them
    logprobs: dict[str, SampledToken] = field(default_factory=dict)
    # the ids of the grammars (`StepPlan.grammars`) built since the worker's last result
    grammars_built: list[int] = field(default_factory=list)

    def to_plain(self) -> list:
        # columns, not one list per token: the ids of the requests, their tokens' ids, and
        # the tokens with logprobs (None if none has)
        sampled, logprobs = self.sampled, self.logprobs
        return [self.step_id, list(sampled), list(sampled.values()),
                {rid: list(t) for rid, t in logprobs.items()} if logprobs else None,
                self.forward_seconds, self.grammars_built]

    @classmethod
    def from_plain(cls, plain: list | tuple) -> StepResult:
        step_id, rids, tokens, logprobs, seconds, built = plain
        detailed = {rid: SampledToken.from_plain(t) for rid, t in logprobs.items()} \
            if logprobs else {}
        return cls(step_id, dict(zip(rids, tokens)), seconds, detailed, list(built))


@dataclass(frozen=True)
class RequestCost:
    """What an ended request cost, and when the core saw it pass each point, on the
    scheduler's clock (0.0: it never got there). On the output that ends the request."""

    tenant: str
    configured: bool  # its tenant is the config's or an operator's (metrics label it by name)
    queued: float = 0.0  # entered the wait queue
    scheduled: float = 0.0  # first planned into a step
    prefill_done: float = 0.0  # its prompt's KV first complete
    finished: float = 0.0
    kv_block_seconds: float = 0.0  # blocks held, times how long
    compute_seconds: float = 0.0  # its tokens' share of each step's forward time
    preemptions: int = 0

    def to_plain(self) -> list:
        return [self.tenant, self.configured, self.queued, self.scheduled, self.prefill_done,
                self.finished, self.kv_block_seconds, self.compute_seconds, self.preemptions]


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[SampledToken] | None = None
    # accounting, filled at least on the finishing output
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    preemptions: int = 0
    recomputed_tokens: int = 0
    error: str = ""  # what the client's `Error` says when it ended with ERROR ("": a default)
    cost: RequestCost | None = None  # on the output that ends a request the core held

    def to_plain(self) -> list:
        logprobs = None if self.logprobs is None else [t.to_plain() for t in self.logprobs]
        cost = None if self.cost is None else self.cost.to_plain()
        return [self.request_id, self.new_token_ids, self.finished, self.finish_reason, logprobs,
                self.prompt_tokens, self.cached_tokens, self.preemptions, self.recomputed_tokens,
                self.error, cost]

    @classmethod
    def from_plain(cls, plain: list | tuple) -> RequestOutput:
        (rid, tokens, finished, reason, logprobs, prompt, cached, preemptions, recomputed, error,
         cost) = plain
        if logprobs is not None:
            logprobs = [SampledToken.from_plain(t) for t in logprobs]
        return cls(rid, list(tokens), finished, None if reason is None else FinishReason(reason),
                   logprobs, prompt, cached, preemptions, recomputed, error,
                   None if cost is None else RequestCost(*cost))


@dataclass
class StepOutputs:
    """What one applied step produced, as columns: `request_ids[i]` goes on with the one
    token `token_ids[i]` (no logprobs, not its last); everything else — a request's end, a
    token with logprobs, a request ended while planning — is a whole `RequestOutput` in
    `outputs`. Most of a step's requests are in the columns: one string and one int each,
    for the core to make and the actors to pass on."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.request_ids) + len(self.outputs)

    def __iter__(self) -> Iterator[RequestOutput]:
        """Every output as a `RequestOutput`: the whole ones, then the columns' (the view of
        callers that take a step's outputs one by one, as the in-process engine does)."""
        yield from self.outputs
        for rid, token in zip(self.request_ids, self.token_ids):
            yield RequestOutput(rid, [token])

    def to_plain(self) -> list:
        return [self.request_ids, self.token_ids, [out.to_plain() for out in self.outputs]]

    @classmethod
    def from_plain(cls, plain: list | tuple) -> StepOutputs:
        rids, tokens, outputs = plain
        return cls(list(rids), list(tokens), [RequestOutput.from_plain(o) for o in outputs])
