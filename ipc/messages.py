"""The messages on the wire: the client protocol and the control protocol, as frozen
dataclasses with stable type tags.

This is all the client library and the console speak; `ipc.codec` encodes it. `SamplingParams`,
`FinishReason` and `RejectCode` come from `vocabulary`. Durations are seconds on the daemon's
monotonic clock. See docs/wire-protocol.md for every message and the version history.

What does not belong here: encoding (see `codec`), sockets, anything from `sluice.actors`,
messages that never leave the daemon (`sluice.actors.runtime.messages`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from sluice.ipc.vocabulary import FinishReason, RejectCode, SamplingParams, TenantLimits

PROTOCOL_MAJOR = 2
# 2.2: `SamplingParams` may carry a logit bias (`logit_bias_ids`, `logit_bias_values`) and a
#      grammar (`grammar_kind`, `grammar`); chat requests OpenAI's tools (`Generate.tools`,
#      `ChatMessage.tool_calls`, `ChatMessage.tool_call_id`: JSON texts and an id, empty by
#      default); the control status counts `drain_refusals`. Nested messages are sent whole,
#      and a reader ignores only a newer minor version's top-level fields: a 2.1 daemon
#      refuses every `Generate` of a 2.2 client, naming the first new field (upgrade the
#      daemon first), and so never drops a constraint silently
# 2.1: `ServerInfo.max_credits` says how many credits the daemon lets a request hold, so a
#      client never waits for more chunks than it will be sent. A 2.0 client cannot read a
#      2.1 `ServerInfo` (its codec refuses the field); from 2.1 on a reader ignores the
#      fields a newer minor version added to a message, so later additions stay compatible
# 2.0: `Finished.timings` names each point a request passed (received, tokenized, queued,
#      scheduled, prefill done, first token sent, finished) and the spans derived from them;
#      `Accepted` has no `cached_tokens` (the prefix match happens after it is sent: the
#      count is in `Finished.usage`). A 1.x peer cannot read a 2.0 `Finished`. `Generate`
#      may carry a `timeout`, `Rejected` a `retry_after`; tenants' limits list token rates,
#      a KV cap, a priority clamp and a default timeout; `StatusReport.daemon` says what the
#      daemon runs (version, model, executor, device, scheduler settings).
# 1.1: `Generate.sampling` may ask for `logprobs`
# 1.2: `ControlSnapshot.detail` is a typed `ConsoleDetail` instead of free-form maps; a 1.1
#      console cannot read it (and a 1.2 console refuses a 1.1 daemon's detail)
# 1.3: `InjectFault.target` names the connection a `vanish_stream` fault drops
# 1.4: `Chunk.logprobs` holds a `TokenLogprobs` per token (its text and the most likely
#      alternatives) instead of a bare float; only a request that asked for `logprobs` gets
#      one, and a 1.3 peer that asked (its client library could not) cannot read it
PROTOCOL_MINOR = 2
PROTOCOL_VERSION = f"{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"


# -- nested wire values ---------------------------------------------------------------------


@dataclass(frozen=True)
class ChatMessage:
    role: str  # system | user | assistant | tool
    content: str
    # an assistant turn's function calls, as the JSON text of OpenAI's `tool_calls` list
    tool_calls: str = ""
    tool_call_id: str = ""  # a `tool` turn: the call it answers


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a sampled position."""

    token_id: int
    token: str  # the token's text alone (a lone piece of a UTF-8 character shows as U+FFFD)
    logprob: float


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token under the model: the log-softmax of the position's raw logits (before
    temperature, penalties or any cut), the token's text alone, and the `logprobs` most
    likely tokens there, most likely first."""

    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    recomputed_tokens: int = 0  # tokens computed again after preemption or a worker restart


@dataclass(frozen=True)
class Timings:
    """When the request passed each point of the daemon, in seconds after the daemon
    received it, every point read off the daemon's one monotonic clock as it happened; 0.0
    for a point it never reached (one cancelled while it waited was never scheduled). Then
    the spans derived from those points, 0.0 where a point they need is missing."""

    tokenized: float = 0.0  # its prompt's token ids were ready
    queued: float = 0.0  # it entered the scheduler's wait queue
    scheduled: float = 0.0  # it was first planned into a step
    prefill_done: float = 0.0  # its prompt's KV was first complete
    first_token: float = 0.0  # its first token left the daemon for the client
    finished: float = 0.0  # its `Finished` left the daemon
    queue: float = 0.0  # queued -> scheduled
    prefill: float = 0.0  # scheduled -> prefill_done
    ttft: float = 0.0  # received -> first_token
    tpot: float = 0.0  # first_token -> finished, per completion token after the first
    e2e: float = 0.0  # received -> finished


# -- client -> daemon -----------------------------------------------------------------------


@dataclass(frozen=True)
class Generate:
    TAG: ClassVar[int] = 1
    request_id: str  # chosen by the client, unique within its connection
    prompt: str | None = None  # exactly one of prompt, messages, prompt_ids
    messages: tuple[ChatMessage, ...] | None = None  # rendered with the chat template
    prompt_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = SamplingParams()  # range-checked as the frame is decoded
    priority: int = 0  # higher runs first under the priority policy
    tenant: str = "default"
    credits: int = 16  # chunks the client can take before its first Credit
    # seconds from the daemon's receipt after which the request ends with `timeout`,
    # waiting or running (None: its tenant's default, if it has one)
    timeout: float | None = None
    # the functions the model may call, as the JSON text of OpenAI's `tools` list: the chat
    # template is given them (a template that takes none gets them in a system preamble)
    tools: str | None = None


@dataclass(frozen=True)
class Credit:
    TAG: ClassVar[int] = 2
    request_id: str
    chunks: int  # how many more chunks the client can take
    # A request is sent at most `sampling.max_tokens` chunks with tokens, and one without,
    # carrying the text held back for its stop strings (only with stop strings): credits
    # past that are never used.


@dataclass(frozen=True)
class Cancel:
    TAG: ClassVar[int] = 3
    request_id: str


@dataclass(frozen=True)
class Heartbeat:
    """Sent both ways; a peer that stays silent past the heartbeat timeout is gone."""

    TAG: ClassVar[int] = 4
    nonce: int = 0


@dataclass(frozen=True)
class Describe:
    """Ask for `ServerInfo`: what any client may know about the daemon."""

    TAG: ClassVar[int] = 5


# -- daemon -> client -----------------------------------------------------------------------


@dataclass(frozen=True)
class Accepted:
    TAG: ClassVar[int] = 16
    request_id: str
    prompt_tokens: int


@dataclass(frozen=True)
class Rejected:
    TAG: ClassVar[int] = 17
    request_id: str  # empty when the frame was too broken to name one
    code: RejectCode
    message: str
    field: str = ""  # the offending field, dotted (e.g. "sampling.top_p")
    # seconds after which the same request should be taken (a tenant over its token rate);
    # 0.0: the daemon has no estimate
    retry_after: float = 0.0


@dataclass(frozen=True)
class Chunk:
    TAG: ClassVar[int] = 18
    request_id: str
    text: str  # never splits a UTF-8 character, never contains a stop string
    token_ids: tuple[int, ...]
    # one per token id, when the request asked for `sampling.logprobs`
    logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class Finished:
    TAG: ClassVar[int] = 19
    request_id: str
    reason: FinishReason
    usage: Usage = Usage()
    timings: Timings = Timings()


@dataclass(frozen=True)
class Error:
    """A request failed inside the daemon; a `Finished(error)` follows."""

    TAG: ClassVar[int] = 20
    request_id: str
    message: str


@dataclass(frozen=True)
class ServerInfo:
    TAG: ClassVar[int] = 21
    protocol_version: str
    model: str
    max_model_len: int = 0
    # the largest frame the daemon reads; a larger one costs the client its connection
    # unanswered (ZeroMQ drops the peer), so the client library refuses it locally. 0: unknown
    max_frame_bytes: int = 0
    # the credits a request may hold: a larger grant is clamped to it, so a client that tops
    # up only after taking more chunks than this would wait for ever. 0: unknown
    max_credits: int = 0


# -- operator <-> control socket ------------------------------------------------------------


@dataclass(frozen=True)
class WorkerStatus:
    state: str  # starting | ready | restarting | failed
    restarts: int = 0
    pid: int = 0  # the worker process, 0 when there is none (null executor)
    # why the worker is `failed` (it could not start after its attempts); empty otherwise
    failure: str = ""
    dtype: str = ""  # the weights' dtype the worker runs ("" for the null executor)
    kv_dtype: str = ""  # the KV pool's dtype
    oom_steps: int = 0  # steps the worker ran out of memory in, each planned again smaller
    # a tensor-parallel worker group's processes, rank 0 (`pid`) first, 0 for a rank on
    # another host; empty for one process
    rank_pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVStatus:
    total_blocks: int = 0
    free_blocks: int = 0
    used_blocks: int = 0
    cached_blocks: int = 0


@dataclass(frozen=True)
class RequestCounts:
    waiting: int = 0
    running: int = 0
    paused: int = 0


@dataclass(frozen=True)
class Counters:
    accepted: int = 0
    finished: int = 0
    cancelled: int = 0
    rejected: int = 0
    preemptions: int = 0  # every cause
    priority_preemptions: int = 0  # of those, for a higher-priority arrival


@dataclass(frozen=True)
class GatewayStats:
    """The client edge since the daemon started: what it dropped and whom it refused."""

    dropped_frames: int = 0  # client frames discarded unanswered (docs/configuration.md)
    forgotten_peers: int = 0  # connections dropped for not reading what they were sent
    refused_connections: int = 0  # new connections refused over the connection cap
    # requests refused because the daemon was draining, by the client socket and HTTP
    drain_refusals: int = 0


@dataclass(frozen=True)
class SchedulerSettings:
    """The `[scheduler]` settings the daemon runs with, as it resolved them: those that decide
    what a load measures, so that two benchmark runs compare only when they agree."""

    policy: str = ""  # fcfs | priority | srpt | fair
    order: str = ""  # decode_first | prefill_first
    admission: str = ""  # optimistic | reserve
    token_budget: float = 0.0  # weighted prompt and output tokens of one step
    prefill_weight: float = 0.0
    decode_weight: float = 0.0
    decode_share: float = 0.0
    max_prefill_chunk: int = 0  # prompt tokens of one request per step
    max_prefilling: int = 0  # requests prefilling in one step
    max_running: int = 0  # requests holding KV and being stepped
    max_queued: int = 0
    max_wait: float | None = None  # seconds before a waiting request goes first; None: never
    block_size: int = 0  # tokens per KV block
    kv_high_watermark: float = 0.0
    kv_low_watermark: float = 0.0
    enable_prefix_caching: bool = False


@dataclass(frozen=True)
class DaemonFacts:
    """What the daemon runs, fixed from its start; empty from a daemon that does not say.
    The weights' dtype is the worker's, in `WorkerStatus`, as it changes with the worker."""

    version: str = ""  # of the sluice package the daemon runs
    model: str = ""  # its name, as `ServerInfo` gives it
    model_path: str = ""  # the model file (under the null executor, the tokenizer's)
    executor: str = ""  # model | null
    device: str = ""  # the worker's torch device; "" for the null executor
    scheduler: SchedulerSettings = SchedulerSettings()


# -- the console's detail, nested in a ControlSnapshot ----------------------------------------


@dataclass(frozen=True)
class KVDetail:
    """The KV pool beyond its block counts (those are in `StatusReport.kv`)."""

    usage: float = 0.0  # used blocks / total blocks
    high_watermark: float = 1.0  # admission stops at this usage ...
    low_watermark: float = 1.0  # ... and starts again below this one
    admission_open: bool = True
    block_size: int = 0  # tokens per block
    prefix_cache_hit_ratio: float = 0.0  # hits per lookup since the scheduler started


@dataclass(frozen=True)
class PlanComposition:
    """What the latest step's plan held; all zero before the first step."""

    seqs: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    budget_used: float = 0.0  # weighted tokens (see the scheduler's token_budget), of ...
    token_budget: float = 0.0  # ... what one step may spend


@dataclass(frozen=True)
class TenantTotals:
    """What a tenant has used since the scheduler started."""

    service: float = 0.0  # the fair policy's weighted count of tokens computed
    prefill_tokens: int = 0
    decode_tokens: int = 0
    recomputed_tokens: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    kv_block_seconds: float = 0.0
    finished: int = 0
    rejected: int = 0


@dataclass(frozen=True)
class TenantRow:
    """One tenant: its settings, its live requests and what it has used."""

    weight: float = 1.0
    limits: TenantLimits = TenantLimits()
    configured: bool = False  # set up by the config or an operator, not only named by a client
    queues: dict[str, int] = field(default_factory=dict)  # its live requests by state
    waiting: int = 0
    running: int = 0  # requests holding KV, not counting paused ones
    virtual_time: float = 0.0  # the fair policy's clock of the tenant
    totals: TenantTotals = TenantTotals()
    # what its token buckets hold now (None: no rate of that kind)
    input_tokens_available: float | None = None
    output_tokens_available: float | None = None


@dataclass(frozen=True)
class RequestRow:
    request_id: str  # the daemon-wide id, what `CancelCommand` takes
    tenant: str
    state: str  # waiting | prefilling | decoding | paused | preempted
    age: float  # seconds since it arrived
    prompt_tokens: int
    output_tokens: int
    blocks: int  # KV blocks it holds
    paused: bool  # its client is slow: no decoding until it reads


@dataclass(frozen=True)
class Percentiles:
    p50: float = 0.0
    p95: float = 0.0
    p99: float = 0.0


@dataclass(frozen=True)
class LatencySummary:
    """Over the latest samples the scheduler keeps (seconds)."""

    ttft: Percentiles = Percentiles()  # time to first token
    itl: Percentiles = Percentiles()  # inter-token latency
    tokens_per_second: float = 0.0  # output tokens over the last few seconds
    output_tokens: int = 0  # since the scheduler started


@dataclass(frozen=True)
class ConsoleDetail:
    """What the console shows beyond the `StatusReport` beside it, which already says the
    worker's state, whether the daemon drains, the KV block counts and the counters."""

    step: int = 0  # steps the scheduler has planned since it started
    policy: str = ""  # fcfs | priority | srpt | fair
    queues: dict[str, int] = field(default_factory=dict)  # live requests by state
    kv: KVDetail = KVDetail()
    last_step: PlanComposition = PlanComposition()
    rejected: int = 0  # requests the scheduler refused at admission
    ended: dict[str, int] = field(default_factory=dict)  # by finish reason, named lower case
    # configured tenants and those with live requests, by name
    tenants: dict[str, TenantRow] = field(default_factory=dict)
    # idle tenants a client named, summed: one entry however many names clients invent
    other_tenants: TenantTotals = TenantTotals()
    requests: tuple[RequestRow, ...] = ()  # live requests, at most a few hundred
    latency: LatencySummary = LatencySummary()


@dataclass(frozen=True)
class StatusQuery:
    TAG: ClassVar[int] = 32
    check_invariants: bool = False  # also run the KV consistency check


@dataclass(frozen=True)
class StatusReport:
    TAG: ClassVar[int] = 33
    state: str  # serving | draining | stopped
    worker: WorkerStatus
    kv: KVStatus
    requests: RequestCounts
    counters: Counters
    connections: int = 0
    invariant_errors: tuple[str, ...] = ()  # empty when consistent (or not checked)
    gateway: GatewayStats = GatewayStats()  # the client edge's counters, from the gateway
    daemon: DaemonFacts = DaemonFacts()  # what it runs, from the control actor


@dataclass(frozen=True)
class Subscribe:
    """Ask for a `ControlSnapshot` every 250 ms for `ttl` seconds; renew before it runs out."""

    TAG: ClassVar[int] = 34
    ttl: float = 5.0


@dataclass(frozen=True)
class ControlSnapshot:
    TAG: ClassVar[int] = 35
    seq: int  # increases by one per snapshot the daemon publishes
    status: StatusReport
    detail: ConsoleDetail | None = None  # None: no scheduler detail; the console shows zeros


@dataclass(frozen=True)
class DrainCommand:
    """Stop admitting; running requests get `deadline` seconds, then are cancelled."""

    TAG: ClassVar[int] = 36
    deadline: float | None = None  # None waits for every running request


@dataclass(frozen=True)
class ResumeCommand:
    """Admit again after a drain."""

    TAG: ClassVar[int] = 37


@dataclass(frozen=True)
class ReconcileCommand:
    """Compare the request table, block table and live connections; free what is orphaned."""

    TAG: ClassVar[int] = 38


@dataclass(frozen=True)
class RecoverCommand:
    """Restart the worker (or bring a stopped one back); interrupted requests recompute."""

    TAG: ClassVar[int] = 39


@dataclass(frozen=True)
class CancelCommand:
    TAG: ClassVar[int] = 40
    request_id: str  # the daemon-wide id shown by the console and `status`


@dataclass(frozen=True)
class TenantSet(TenantLimits):
    """Change one tenant's weight or limits at run time: each limit of `TenantLimits` that
    is given (by keyword), and the fields below."""

    TAG: ClassVar[int] = 41
    name: str
    weight: float | None = None
    # False: unset fields keep their value; True: they return to the defaults (weight 1, no
    # limit), so the tenant becomes exactly what this message says
    reset: bool = False
    # prefix-cache sharing (default: the tenant's cache hits are its own)
    share_prefix_cache: bool | None = None
    prefix_cache_group: str | None = None


@dataclass(frozen=True)
class InjectFault:
    """Debug builds only (`debug_faults` in the config): break the daemon on purpose.

    Kinds: `leak_block` (a KV block referenced by no request), `vanish_stream` (drop one
    connection's stream without telling anyone), `worker_down` (stop the worker),
    `crash_scheduler` (the scheduler actor raises after answering; its supervisor restarts it),
    `oom_next_step` (the worker's next step raises torch's out-of-memory error in its forward).
    """

    TAG: ClassVar[int] = 42
    kind: str
    # vanish_stream: the connection (its routing id in hex) whose stream to drop; "": the newest
    target: str = ""


@dataclass(frozen=True)
class CommandReply:
    TAG: ClassVar[int] = 43
    command: str  # drain | resume | reconcile | recover | cancel | tenant | fault
    ok: bool
    message: str  # one line for the operator
    findings: tuple[str, ...] = ()  # reconcile: every discrepancy found (and fixed)


WIRE_MESSAGES: tuple[type, ...] = (
    Generate, Credit, Cancel, Heartbeat, Describe,
    Accepted, Rejected, Chunk, Finished, Error, ServerInfo,
    StatusQuery, StatusReport,
    Subscribe, ControlSnapshot, DrainCommand, ResumeCommand, ReconcileCommand, RecoverCommand,
    CancelCommand, TenantSet, InjectFault, CommandReply,
)  # fmt: skip
CLIENT_MESSAGES: tuple[type, ...] = (Generate, Credit, Cancel, Heartbeat, Describe)
SERVER_MESSAGES: tuple[type, ...] = (
    Accepted, Rejected, Chunk, Finished, Error, ServerInfo, Heartbeat
)  # fmt: skip
CONTROL_REQUESTS: tuple[type, ...] = (
    StatusQuery, Subscribe, DrainCommand, ResumeCommand, ReconcileCommand, RecoverCommand,
    CancelCommand, TenantSet, InjectFault,
)  # fmt: skip
CONTROL_REPLIES: tuple[type, ...] = (StatusReport, ControlSnapshot, CommandReply, Rejected)
