"""What an actor tells others about its own state: typed records, sent by the owner.

Actors share nothing, so the daemon, the metrics and other actors learn an actor's state
only from these: asked inside an `Ask` (`WorkerQuery` -> `WorkerState`, `EndpointQuery` ->
`Endpoint`, `MetricsQuery` -> `MetricsSnapshot`, `UsageQuery` -> `UsageSnapshot`), or
reported as it changes (`Backlog`, how many messages an actor has not taken yet, which paces
the Scheduler's steps). Each record is a frozen dataclass of plain typed values, registered
with the internal codec like every message between actors. The client and control protocols stay in `sluice.ipc.messages`;
nothing here goes on the wire to a client.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from sluice.ipc.messages import ControlSnapshot, Timings


@dataclass(frozen=True)
class WorkerFacts:
    """What a worker that passed its health check says about its pool and model."""

    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    dtype: str = ""  # what the worker resolved `auto` to, e.g. "bfloat16"
    kv_dtype: str = ""
    # the attention window of a model whose every layer has one (0: none): the scheduler
    # gives back the KV blocks behind it
    kv_window: int = 0


@dataclass(frozen=True)
class WorkerQuery:
    """Asked of the Executor inside an `Ask`: the worker's state; the answer is `WorkerState`.

    Answered at once, whatever the state (unlike `AskWorker`, which waits for a decision)."""


@dataclass(frozen=True)
class WorkerState:
    state: str  # starting | ready | restarting | failed | null
    facts: WorkerFacts | None  # None until a worker passed its health check
    failure: str = ""  # the last failed start's reason


@dataclass(frozen=True)
class EndpointQuery:
    """Asked of an actor with a socket (Gateway, Control) inside an `Ask`: the address it
    bound (a port 0 or a default path resolved); the answer is `Endpoint`."""


@dataclass(frozen=True)
class Endpoint:
    address: str


@dataclass(frozen=True)
class Histogram:
    """One latency or size histogram the Scheduler keeps: per-bucket counts (not
    cumulative), `counts[i]` for values <= `bounds[i]` and above the bound before it, and a
    last count for values above every bound."""

    # the Scheduler's: ttft | itl | iteration | prefill_chunk | decode_batch; the Usage
    # actor's request timings: ttft | queue | prefill | tpot | e2e
    kind: str
    tenant: str  # "" for every tenant no config or operator created, and for per-step kinds
    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # len(bounds) + 1
    total: float  # the sum of the observed values


@dataclass(frozen=True)
class MetricsQuery:
    """Asked of the Scheduler inside an `Ask`: its snapshot and latency histograms; the
    answer is `MetricsSnapshot`."""


@dataclass(frozen=True)
class MetricsSnapshot:
    snapshot: ControlSnapshot
    histograms: tuple[Histogram, ...]


@dataclass(frozen=True)
class Backlog:
    """Tokenizer or Gateway -> Scheduler: messages in the sender's own inbox not taken yet.

    Sent when the number moved by `BacklogGauge.step` since the last report, or fell to
    zero, so the Scheduler sums numbers at most `step` off without a message per message."""

    actor: str
    depth: int


class BacklogGauge:
    """An actor's reporter of its own inbox depth to the Scheduler (`Backlog`)."""

    def __init__(self, actor: str, step: int = 16):
        self.actor = actor
        self.step = step
        self.reported = 0

    def report(self, depth: int, to) -> None:
        """Tell `to` (an outbox) the depth, if it moved far enough since the last report."""
        if to is None or depth == self.reported:
            return
        if abs(depth - self.reported) >= self.step or depth == 0:
            self.reported = depth
            to.put(Backlog(self.actor, depth))


@dataclass(frozen=True)
class UsageSums:
    """What requests used, in the quantities an operator bills: one request's in its
    `UsageRecord`, a tenant's summed in `TenantUsageTotals`."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    preemptions: int = 0
    kv_block_seconds: float = 0.0
    compute_seconds: float = 0.0

    def plus(self, other: UsageSums) -> UsageSums:
        mine, theirs = self.__dict__, other.__dict__
        return UsageSums(*[mine[name] + theirs[name] for name in _SUM_FIELDS])


_SUM_FIELDS = tuple(f.name for f in fields(UsageSums))


@dataclass(frozen=True)
class UsageRecord:
    """One ended request, as it is billed: Stream (or Tokenizer) -> Usage, inside `Ended`."""

    request_id: str  # the daemon's own id: unique, across restarts too (for de-duplication)
    client_request_id: str  # the client's id, cut to the logged width
    tenant: str
    configured: bool  # a tenant of the config or an operator: metrics label it by name
    start: float  # wall clock (seconds since the epoch): when the daemon received it
    end: float  # when its Finished left (or its stream gave it up)
    finish_reason: str
    sums: UsageSums = UsageSums()
    timings: Timings = Timings()


@dataclass(frozen=True)
class UsageQuery:
    """Asked of the Usage actor inside an `Ask`: its totals; the answer is `UsageSnapshot`."""


@dataclass(frozen=True)
class TenantUsageTotals:
    """What one metrics label's tenants used, summed over their usage records."""

    tenant: str  # "" for every tenant no config or operator created
    requests: tuple[tuple[str, int], ...] = ()  # (finish reason, count)
    sums: UsageSums = UsageSums()


@dataclass(frozen=True)
class UsageSnapshot:
    tenants: tuple[TenantUsageTotals, ...]
    rejected: tuple[tuple[str, int], ...]  # (reject code, count), as the streams and the gateway sent them
    histograms: tuple[Histogram, ...]  # request timings: ttft, queue, prefill, tpot, e2e
    records: int = 0  # usage records taken since the daemon started
