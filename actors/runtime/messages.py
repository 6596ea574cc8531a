"""Messages between the actors of one daemon: never on the wire, never in the client package.

They travel over `inproc://` sockets with `sluice.ipc.internal`'s codec, and carry the wire's own values where they pass one
along (a client's `Generate`, the `Chunk`s and `Finished` for a connection, a status report).
An actor is named in a message by the address of its inbox, never by an object. The step
plan and result the Scheduler and the worker exchange are the scheduler core's types
(`sluice.actors.scheduler.plan`); the records actors report their own state in are in
`sluice.actors.runtime.reports`.

What does not belong here: the client and control protocols (`sluice.ipc.messages`), which
the client library and the console speak without importing anything of the daemon.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from sluice.actors.runtime.reports import (
    Endpoint, EndpointQuery, MetricsQuery, MetricsSnapshot, UsageQuery, UsageRecord,
    UsageSnapshot, WorkerQuery, WorkerState,
)  # fmt: skip
from sluice.actors.scheduler.plan import RequestCost, StepOutputs as CoreStepOutputs
from sluice.ipc.messages import (
    Accepted, CancelCommand, Chunk, CommandReply, ControlSnapshot, DrainCommand, Error,
    Finished, GatewayStats, Generate, InjectFault, ReconcileCommand, RecoverCommand, Rejected,
    ResumeCommand, StatusQuery, StatusReport, Subscribe, TenantSet, TokenLogprobs,
)  # fmt: skip
from sluice.ipc.vocabulary import FinishReason, RejectCode, SamplingParams

@dataclass(frozen=True)
class Admit:
    """Tokenizer -> Scheduler: a validated, tokenized request."""

    request_id: str  # daemon-wide id
    connection: bytes
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams  # the client's, as it arrived
    priority: int
    tenant: str
    arrival: float  # time.monotonic() when the Stream received it
    timeout: float | None = None  # the client's, seconds from arrival


@dataclass(frozen=True)
class Release:
    """Stream -> Tokenizer -> Scheduler: end these requests now and free their KV.

    The Tokenizer ends those it still holds and forwards the rest behind their `Admit`.
    `unattended` is set when the Stream gave the requests up without waiting for their end
    (its client is gone, or it failed): for each, when its first token left the daemon
    (monotonic; 0.0 if none did). Their usage records are then written where they end."""

    request_ids: tuple[str, ...]
    reason: FinishReason
    unattended: tuple[float, ...] | None = None


@dataclass(frozen=True)
class PauseDecoding:
    """Stream -> Tokenizer -> Scheduler: stop decoding the request (its client is slow); its
    KV stays."""

    request_id: str


@dataclass(frozen=True)
class ResumeDecoding:
    """Stream -> Tokenizer -> Scheduler: decode a paused request again (not `ResumeCommand`,
    the operator's end of a drain)."""

    request_id: str


@dataclass(frozen=True)
class ClientGone:
    connection: bytes


@dataclass(frozen=True)
class WorkerLost:
    """Executor -> Scheduler: the worker died; every in-flight step is void."""

    reason: str


@dataclass(frozen=True)
class WorkerReady:
    """Executor -> Scheduler: a (re)started worker passed its health check (also the answer
    to `AskWorker` while the worker serves)."""

    restarts: int
    pid: int = 0
    dtype: str = ""  # what the worker resolved --dtype to (and --kv-dtype below)
    kv_dtype: str = ""
    rank_pids: tuple[int, ...] = ()  # a tensor-parallel group's, rank 0 first


@dataclass(frozen=True)
class WorkerFailed:
    """Executor -> Scheduler: no worker could be started in `attempts` tries in a row.

    A state, not a crash: the executor keeps retrying on a long backoff (or at once on
    `Recover`) and says `WorkerReady` when one passes its health check; until then requests
    get an error saying the worker failed. Also the answer to `AskWorker` in that state."""

    reason: str
    attempts: int
    restarts: int = 0  # starts after the first so far, the failed ones included


@dataclass(frozen=True)
class AskWorker:
    """Scheduler -> Executor: say the worker's state again (a restarted scheduler forgot it).

    Answered with `WorkerReady` or `WorkerFailed`; while a worker is starting there is no
    answer yet: the one that comes when it is decided serves."""


@dataclass(frozen=True)
class ReleaseAll:
    """Daemon or Control -> Scheduler, inside an `Operate`: a drain's deadline passed; end
    every request still live."""


@dataclass(frozen=True)
class Drain:
    """Daemon or Control -> Gateway and Scheduler: admit nothing new (the deadline, if any,
    is kept by whoever sent this)."""


@dataclass(frozen=True)
class Snapshot:
    report: StatusReport


@dataclass(frozen=True)
class Recover:
    """Daemon -> Executor: restart the worker now (replace a serving one; retry a failed one
    without waiting for its backoff)."""


@dataclass(frozen=True)
class Holding:
    """Asked of the Tokenizer inside an `Ask`: how many requests it holds (tokenizing,
    waiting for the scheduler's decision, or streaming); the answer is `Held`."""


@dataclass(frozen=True)
class Held:
    requests: int


@dataclass(frozen=True)
class Encode:
    """Stream -> Tokenizer: a client's Generate, to validate, tokenize and admit."""

    generate: Generate
    request_id: str  # daemon-wide id ("<connection hex>/<client request id>")
    connection: bytes
    reply_to: str  # the address of the Stream actor's inbox
    arrival: float  # time.monotonic() when the Stream received it
    usage_id: str = ""  # its usage record's id, unique across the daemon's restarts


@dataclass(frozen=True)
class AdmissionRefused:
    """Scheduler -> Tokenizer: the core refused the request (too long, quota, overloaded...);
    the Tokenizer tells the client with a `Rejected`."""

    request_id: str
    code: RejectCode
    message: str
    field: str = ""
    retry_after: float = 0.0  # seconds (0.0: no estimate)


@dataclass(frozen=True)
class StepOutputs:
    """Scheduler -> Tokenizer: what one iteration produced (the core's own columns), after
    the requests the core admitted since the last one, each as
    (request id, prompt tokens): their `Accepted` goes out with the step's chunks, in one
    frame per connection, not in a frame of its own. The scheduler holds an admission for
    the step in flight, for `ACCEPTED_HOLD` at most; with none in flight it sends it at
    once (with no outputs)."""

    outputs: CoreStepOutputs
    admitted: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class StopMatched:
    """Tokenizer -> Scheduler: a stop string matched; end the request with STOP (its client
    has all its text; the Tokenizer sends the `Finished` once this end, with its cost,
    comes back)."""

    request_id: str


@dataclass(frozen=True)
class Ending:
    """Tokenizer -> Stream, right before a request's `Finished`: what its usage record needs
    that the client is not told (None when the scheduler never held the request)."""

    request_id: str  # the client's id, as in the Finished
    cost: RequestCost | None
    recorded: bool = False  # its Stream had given it up: the Tokenizer made its record


@dataclass(frozen=True)
class Ended:
    """Stream or Tokenizer -> Usage: the requests that ended, and the codes of the
    rejections sent, while one message was handled."""

    records: tuple[UsageRecord, ...] = ()
    rejected: tuple[RejectCode, ...] = ()


@dataclass(frozen=True)
class ReopenUsageLog:
    """Daemon -> Usage, on SIGHUP: close the usage file and open its path again (rotation)."""


@dataclass(frozen=True)
class Deliver:
    """Tokenizer -> Stream: what one handled message made for one connection, in three parts,
    each in order: `before` (the `Accepted` of requests admitted), the chunks as columns
    (chunk i is request `request_ids[i]`'s `texts[i]`, of tokens `token_ids[i]`, with
    `logprobs[i]` when any chunk has logprobs), then `after` (the rest: a request's `Error`,
    `Ending`, `Finished`, a `Rejected`). A request's chunks come after its `Accepted` and
    before its end, so this order is the one they were made in, as far as each request can
    tell. Build one with `Delivery`."""

    request_ids: tuple[str, ...] = ()
    texts: tuple[str, ...] = ()
    token_ids: tuple[tuple[int, ...], ...] = ()
    logprobs: tuple[tuple[TokenLogprobs, ...] | None, ...] | None = None
    before: tuple[Accepted, ...] = ()
    after: tuple[ToClient, ...] = ()

    @classmethod
    def of(cls, messages: Iterable[ToClient]) -> Deliver:
        delivery = Delivery()
        delivery.extend(messages)
        return delivery.message()

    def chunks(self) -> Iterator[Chunk]:
        """The chunks, as the wire's `Chunk`s."""
        logprobs = self.logprobs or itertools.repeat(None)
        return map(Chunk, self.request_ids, self.texts, self.token_ids, logprobs)


class Delivery:
    """The parts of one `Deliver`, filled message by message."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.texts: list[str] = []
        self.token_ids: list[tuple[int, ...]] = []
        self.logprobs: list[tuple[TokenLogprobs, ...] | None] = []
        self.any_logprobs = False
        self.before: list[Accepted] = []
        self.after: list[ToClient] = []

    def chunk(self, request_id: str, text: str, token_ids: tuple[int, ...],
              logprobs: tuple[TokenLogprobs, ...] | None = None) -> None:
        self.request_ids.append(request_id)
        self.texts.append(text)
        self.token_ids.append(token_ids)
        self.logprobs.append(logprobs)
        if logprobs is not None:
            self.any_logprobs = True

    def append(self, msg: ToClient) -> None:
        if type(msg) is Chunk:
            self.chunk(msg.request_id, msg.text, msg.token_ids, msg.logprobs)
        elif type(msg) is Accepted:
            self.before.append(msg)
        else:
            self.after.append(msg)

    def extend(self, messages: Iterable[ToClient]) -> None:
        for msg in messages:
            self.append(msg)

    def message(self) -> Deliver:
        return Deliver(tuple(self.request_ids), tuple(self.texts), tuple(self.token_ids),
                       tuple(self.logprobs) if self.any_logprobs else None,
                       tuple(self.before), tuple(self.after))


@dataclass(frozen=True)
class Outbound:
    """Stream -> Gateway: encoded messages for one client, sent as one multipart message."""

    connection: bytes
    frames: tuple[bytes, ...]


@dataclass(frozen=True)
class StreamClosed:
    """Stream -> Gateway: the connection is gone and its stream has released everything.

    Gateway -> Stream, in answer: the gateway routes nothing more to it; the stream ends once
    it has refused whatever was routed to it before this."""

    connection: bytes


@dataclass(frozen=True)
class FailAll:
    """Gateway -> Stream: end every request of the connection with an error, then close."""

    message: str


@dataclass(frozen=True)
class Ask:
    """Control -> Scheduler: a status query; the answer comes back as `Reply(token, Snapshot)`
    (a `ControlSnapshot` for `Subscribe`). Control -> Gateway: `ListConnections`."""

    query: Question
    reply_to: str  # the asker's inbox address
    token: int  # echoed in the Reply, so concurrent questions get their own answers


@dataclass(frozen=True)
class ListConnections:
    """Control -> Gateway, inside an `Ask`: which client connections are live; the answer is
    `Connections`."""


@dataclass(frozen=True)
class Connections:
    ids: frozenset[bytes]
    streams: tuple[str, ...] = ()  # their Stream actors' inboxes, for drain to ask (`Holding`)
    stats: GatewayStats = GatewayStats()  # the gateway's counters, for status reports
    # requests being answered, from a front whose requests share a stream (HTTP's)
    answering: int = 0


@dataclass(frozen=True)
class EndDrain:
    """Control -> Gateway and Scheduler: admit again (what `ResumeCommand` asks for)."""


@dataclass(frozen=True)
class Operate:
    """Control -> Scheduler: an operator command; a `Reply(token, CommandReply)` goes to
    `reply_to` (nowhere when it is empty).

    `connections` is the set of live client connections (for reconcile)."""

    command: Command
    reply_to: str = ""
    token: int = 0
    connections: frozenset[bytes] = frozenset()


@dataclass(frozen=True)
class Reply:
    """The answer to an `Ask` or `Operate`, matched to it by `token`."""

    token: int
    message: Answer


# what a Stream passes on to its client
ToClient = Accepted | Rejected | Chunk | Finished | Error | Ending
# what an `Ask` asks, and what an `Operate` commands
Question = (StatusQuery | Subscribe | ListConnections | Holding | WorkerQuery | EndpointQuery
            | MetricsQuery | UsageQuery)
Command = (DrainCommand | ResumeCommand | ReconcileCommand | RecoverCommand | CancelCommand
           | TenantSet | InjectFault | ReleaseAll)
# what a `Reply` answers with
Answer = (StatusReport | ControlSnapshot | Snapshot | CommandReply | Connections | Held
          | WorkerState | Endpoint | MetricsSnapshot | UsageSnapshot)
