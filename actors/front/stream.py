"""The Stream actor: one per client connection, the daemon's side of backpressure.

It sends a request's chunks within the client's credits (merging what it buffers), pauses and
resumes the request at its watermarks, ends requests paused past `pause_timeout` and all of a
connection's requests when it is gone, and makes a request's usage record when its `Finished`
leaves. A ZeroMQ client's grammar is checked here (`intake.GrammarChecks`, in a child
process) before its request goes on. Everything it says about a request goes to the
Tokenizer, the one route to the Scheduler. What it says to its client goes to a
`ClientSink`: one frame per handled message for a ZeroMQ connection, typed messages for an
HTTP request. A crash ends only its connection's requests (it is supervised as transient).
See docs/architecture.md, "A token's path", "Flow control" and "Failure semantics".
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import structlog
import trio

from sluice.actors.runtime import messages as am
from sluice.actors.runtime.base import Actor, Handler, Outbox, Outboxes
from sluice.actors.front.intake import GrammarBusy, GrammarChecks, check_generate
from sluice.actors.front.limits import Limits, clip
from sluice.actors.usage.records import complete, record, since
from sluice.ipc import messages as m
from sluice.ipc.codec import Codec

log = structlog.get_logger("sluice.stream")

_ABORTED = (m.FinishReason.CANCELLED, m.FinishReason.TIMEOUT, m.FinishReason.ERROR)
# seconds a closed stream waits for the ends of the requests it gave up, whose usage records
# it may have to make (they end in milliseconds unless the daemon is stalled)
ABANDONED_WAIT = 2.0


@dataclass(frozen=True)
class StreamConfig:
    heartbeat_interval: float = 1.0  # seconds between the daemon's heartbeats to a client
    heartbeat_timeout: float = 10.0  # a client silent this long is gone
    pause_timeout: float = 30.0  # a request paused this long ends with `timeout`
    high_watermark: int = 32  # buffered chunks that pause a request
    low_watermark: int = 8  # buffered chunks at or below which it resumes


class ClientSink(Protocol):
    """Where a stream's messages to its client go, in order, once per handled message."""

    def send(self, connection: bytes, messages: list) -> None: ...


class FrameSink:
    """A ZeroMQ connection's: one frame per handled message, put to the gateway.

    One frame, not one per message: a socket send per token would cost more than the rest
    of the daemon's work for that token."""

    def __init__(self, codec: Codec, gateway: Outbox):
        self.codec = codec
        self.gateway = gateway

    def send(self, connection: bytes, messages: list) -> None:
        self.gateway.put(am.Outbound(connection, (self.codec.encode_batch(messages),)))


@dataclass
class _Request:
    client_id: str
    daemon_id: str
    credits: int
    usage_id: str
    tenant: str
    received: float  # time.monotonic()
    started: float  # time.time(), the same moment
    first_sent: float = 0.0  # time.monotonic() when its first token left (0.0: not yet)
    buffer: deque[m.Chunk] = field(default_factory=deque)
    finished: m.Finished | None = None  # waits behind buffered chunks
    cost: am.Ending | None = None  # what the usage record needs from the scheduler
    paused_since: float | None = None
    ending: bool = False  # a Release was sent; only the Finished is still expected


class Stream(Actor):
    def __init__(
        self,
        connection: bytes,
        *,
        config: StreamConfig,
        codec: Codec,
        gateway: Outbox,
        tokenizer: Outbox,
        limits: Limits = Limits(),
        sink: ClientSink | None = None,
        usage: Outbox | None = None,
        grammars: GrammarChecks | None = None,
        tenants_proven: bool = False,
    ):
        super().__init__(f"stream-{connection.hex()}")
        self.connection = connection
        self.config = config
        self.limits = limits
        self.gateway = gateway  # the front that routes to this stream, told when it closes
        self.sink = sink or FrameSink(codec, gateway)
        self.tokenizer = tokenizer  # the one route of this stream's requests
        self.usage = usage  # where usage records go
        # checks each request's grammar before it goes on; None: the front checked it already
        self.grammars = grammars
        # whose turn this connection's grammar checks wait in: its tenant where a key proves
        # it (CURVE), else the connection itself, so that strangers on the plain socket who
        # all name `default` do not queue behind one another's slow grammars
        self.grammar_party = None if tenants_proven else f"connection {connection.hex()}"
        self.usage_prefix = os.urandom(6).hex()  # with a count: ids unique across restarts
        self.usage_serial = 0
        self.closed = False
        self.askers = Outboxes()  # drain's questions are answered here

    def reset(self) -> None:
        self.outgoing: list = []  # messages of this message's handling, sent together
        self.records: list = []  # usage records of this message's handling
        self.rejected: list[m.RejectCode] = []  # codes of the rejections it sent
        self.requests: dict[str, _Request] = {}
        # requests given up without waiting (client gone), whose end may already have been on
        # its way here: that end is still recorded (at most one connection's worth)
        self.abandoned: dict[str, _Request] = {}
        self.last_heard = trio.current_time()

    def handlers(self) -> dict[type, Handler]:
        return {
            m.Generate: self.on_generate,
            m.Credit: self.on_credit,
            m.Cancel: self.on_cancel,
            m.Heartbeat: self.on_heartbeat,
            am.Deliver: self.on_deliver,
            am.ClientGone: self.on_client_gone,
            am.FailAll: self.on_fail_all,
            am.Ask: self.on_ask,
            am.StreamClosed: self.on_gateway_forgot,
        }

    async def on_ask(self, msg: am.Ask) -> None:
        """Drain asks (`Holding`) until no request waits here for its Finished to be sent."""
        self.askers.put(msg.reply_to, am.Reply(msg.token, am.Held(len(self.requests))))

    def teardown(self) -> None:
        self.askers.close()

    async def background(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        nursery.start_soon(self._timers)

    # -- from the client ----------------------------------------------------------------------

    async def on_generate(self, msg: m.Generate) -> None:
        self.last_heard = trio.current_time()
        if self.closed:  # routed here before the gateway learnt of the close
            self._reject_closed(msg)
            return
        if msg.request_id in self.requests:
            self._reject(m.Rejected(msg.request_id, m.RejectCode.INVALID,
                                  "a request with this id is still running", "request_id"))
            return
        if msg.credits < 0:
            self._reject(m.Rejected(msg.request_id, m.RejectCode.INVALID,
                                  "must be >= 0", "credits"))
            return
        if (refused := check_generate(msg, self.limits)) is not None:
            self._reject(refused)
            return
        cap = self.limits.max_requests_per_connection
        if len(self.requests) >= cap:
            self._reject(m.Rejected(msg.request_id, m.RejectCode.OVERLOADED,
                                  f"a connection may have at most {cap} open requests",
                                  "max_requests_per_connection"))
            return
        if self.grammars is not None and msg.sampling.constrained:
            # a grammar not seen before is checked in a child process, within its time limit,
            # after its party's earlier checks: this connection's later messages wait behind
            # it, in order
            try:
                problem = await self.grammars.problem(
                    msg.sampling.grammar_kind, msg.sampling.grammar,
                    self.grammar_party or f"tenant {msg.tenant!r}")
            except GrammarBusy as busy:
                self._reject(m.Rejected(msg.request_id, m.RejectCode.OVERLOADED, str(busy),
                                        busy.limit))
                return
            if problem:
                self._reject(m.Rejected(msg.request_id, m.RejectCode.INVALID, problem,
                                        "sampling.grammar"))
                return
            if self.closed:  # closed (a heartbeat timeout) while it was checked
                self._reject_closed(msg)
                return
        daemon_id = f"{self.connection.hex()}/{msg.request_id}"
        credits = min(msg.credits, self.limits.max_credits)
        self.usage_serial += 1
        usage_id = f"{self.usage_prefix}-{self.usage_serial}"
        received = time.monotonic()
        self.requests[msg.request_id] = _Request(msg.request_id, daemon_id, credits, usage_id,
                                                 msg.tenant, received, time.time())
        self.tokenizer.put(am.Encode(msg, daemon_id, self.connection, self.inbox.address,
                                     received, usage_id))

    async def on_credit(self, msg: m.Credit) -> None:
        self.last_heard = trio.current_time()
        request = self.requests.get(msg.request_id)
        if request is not None and msg.chunks > 0:
            # clamped: a huge grant would let one peer fill its queue with every chunk at once
            request.credits = min(request.credits + msg.chunks, self.limits.max_credits)
            self._flush(request)

    async def on_cancel(self, msg: m.Cancel) -> None:
        self.last_heard = trio.current_time()
        request = self.requests.get(msg.request_id)
        if request is not None and not request.ending:
            request.ending = True
            self.tokenizer.put(am.Release((request.daemon_id,), m.FinishReason.CANCELLED))

    async def on_heartbeat(self, msg: m.Heartbeat) -> None:
        self.last_heard = trio.current_time()

    # -- from the tokenizer -----------------------------------------------------------------

    async def on_deliver(self, msg: am.Deliver) -> None:
        for item in msg.before:
            self._take(item)
        requests, send = self.requests, self.outgoing.append
        for chunk in msg.chunks():
            request = requests.get(chunk.request_id)
            if request is None:  # ended already (cancelled, failed); late output is dropped
                continue
            if request.credits > 0 and not request.buffer and request.paused_since is None:
                request.credits -= 1  # the common case: nothing waits, a credit is there
                if not request.first_sent and chunk.token_ids:
                    request.first_sent = time.monotonic()
                send(chunk)
                continue
            request.buffer.append(chunk)
            self._flush(request)
        for item in msg.after:
            self._take(item)

    def _take(self, item: object) -> None:
        """One message of a `Deliver` that is not a chunk."""
        request = self.requests.get(item.request_id)
        if request is None:  # ended already (cancelled, failed); late output is dropped
            if self.abandoned:
                self._late_end(item)
        elif isinstance(item, m.Finished):
            if item.reason in _ABORTED:
                request.buffer.clear()
            request.finished = item
            self._flush(request)
        elif isinstance(item, m.Rejected):
            del self.requests[item.request_id]
            self._reject(item)
        elif isinstance(item, am.Ending):
            request.cost = item
        else:  # Accepted, Error
            self._send(item)

    # -- connection lifetime ------------------------------------------------------------------

    async def on_client_gone(self, msg: am.ClientGone) -> None:
        self._close("disconnected")

    async def on_fail_all(self, msg: am.FailAll) -> None:
        self._fail_requests(msg.message)
        self._close("failed", release=False)

    async def on_gateway_forgot(self, msg: am.StreamClosed) -> None:
        # nothing is routed here any more: the run loop ends, once the ends already on their
        # way for the requests it gave up are in (for their usage records), or after a while
        if not self.abandoned:
            self.close()
        else:
            self._nursery.start_soon(self._close_when_settled)

    async def _close_when_settled(self) -> None:
        with trio.move_on_after(ABANDONED_WAIT):
            while self.abandoned:
                await trio.sleep(0.01)
        self.close()

    async def on_crash(self, exc: BaseException) -> None:
        # the crash is this connection's alone: its requests fail and the stream closes; the
        # supervisor restarts it closed, so it refuses what is still routed to it, then ends.
        # What the crashed handling made is sent: each message matches state it changed (a
        # request whose Finished is there is gone from `requests`, and would get no other)
        self._fail_requests(f"stream failed: {type(exc).__name__}")
        self.after_message()
        self._close("crashed", release=False)

    def _fail_requests(self, message: str) -> None:
        for request in self.requests.values():
            self._send(m.Error(request.client_id, message))
            self._send(m.Finished(request.client_id, m.FinishReason.ERROR))
        self._give_up(m.FinishReason.ERROR)

    def _late_end(self, item: object) -> None:
        """The end of a request given up here, which left the Tokenizer before it learnt so:
        recorded here, unless the Tokenizer did."""
        request = self.abandoned.get(item.request_id)
        if request is None:
            return
        if isinstance(item, am.Ending):
            request.cost = item
        elif isinstance(item, m.Finished):
            del self.abandoned[item.request_id]
            if request.cost is None or not request.cost.recorded:
                self._ended(request, item)

    def _give_up(self, reason: m.FinishReason) -> int:
        """Release every request without waiting for its end; how many there were."""
        requests = list(self.requests.values())
        self.abandoned.update(self.requests)
        self.requests.clear()
        if requests:
            self.tokenizer.put(am.Release(tuple(r.daemon_id for r in requests), reason,
                                          tuple(r.first_sent for r in requests)))
        return len(requests)

    def _close(self, why: str, *, release: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        rids = self._give_up(m.FinishReason.CANCELLED) if release else 0
        # a client that disconnects with nothing in flight closed normally: no news
        level = log.debug if why == "disconnected" and not rids else log.info
        level("client gone", connection=clip(self.connection.hex(), self.limits), why=why,
              released=rids)
        self.gateway.put(am.StreamClosed(self.connection))

    async def _timers(self) -> None:
        cfg = self.config
        tick = min(cfg.heartbeat_interval, cfg.heartbeat_timeout / 4, cfg.pause_timeout / 4)
        next_heartbeat = trio.current_time()
        while not self.closed:
            await trio.sleep(tick)
            now = trio.current_time()
            if now - self.last_heard > cfg.heartbeat_timeout:
                self._close("heartbeat timeout")
                self.after_message()
                return
            if now >= next_heartbeat:
                self._send(m.Heartbeat())
                next_heartbeat = now + cfg.heartbeat_interval
            for request in list(self.requests.values()):
                since = request.paused_since
                if since is None or request.ending or now - since <= cfg.pause_timeout:
                    continue
                request.ending = True
                if request.finished is None:
                    self.tokenizer.put(am.Release((request.daemon_id,), m.FinishReason.TIMEOUT))
                else:  # already done in the scheduler; only the client never read it
                    request.buffer.clear()
                    request.finished = m.Finished(request.client_id, m.FinishReason.TIMEOUT,
                                                  request.finished.usage, request.finished.timings)
                    self._flush(request)
            self.after_message()

    # -- sending ----------------------------------------------------------------------------

    def _flush(self, request: _Request) -> None:
        if request.buffer and request.credits > 0:
            request.credits -= 1
            chunk = _merge(request.buffer)
            if not request.first_sent and chunk.token_ids:
                request.first_sent = time.monotonic()
            self._send(chunk)
            request.buffer.clear()
        if request.finished is not None and not request.buffer:
            finished = self._ended(request, request.finished)
            del self.requests[request.client_id]  # only with its Finished made
            self._send(finished)
            return
        self._apply_watermarks(request)

    def _ended(self, request: _Request, finished: m.Finished) -> m.Finished:
        """`finished` with its timings complete; its usage record made."""
        now, received = time.monotonic(), request.received
        timings = complete(finished.timings, first_token=since(request.first_sent, received),
                           finished=since(now, received),
                           completion_tokens=finished.usage.completion_tokens)
        finished = m.Finished(finished.request_id, finished.reason, finished.usage, timings)
        self.records.append(record(
            usage_id=request.usage_id, client_id=request.client_id, tenant=request.tenant,
            reason=finished.reason, usage=finished.usage, timings=timings,
            cost=request.cost.cost if request.cost is not None else None,
            start=request.started, end=request.started + (now - received), limits=self.limits))
        return finished

    def _apply_watermarks(self, request: _Request) -> None:
        depth = len(request.buffer)
        if request.paused_since is None and depth > self.config.high_watermark:
            request.paused_since = trio.current_time()
            self.tokenizer.put(am.PauseDecoding(request.daemon_id))
        elif request.paused_since is not None and depth <= self.config.low_watermark:
            request.paused_since = None
            if not request.ending:
                self.tokenizer.put(am.ResumeDecoding(request.daemon_id))

    def _send(self, msg: object) -> None:
        self.outgoing.append(msg)

    def _reject_closed(self, msg: m.Generate) -> None:
        self._reject(m.Rejected(msg.request_id, m.RejectCode.OVERLOADED,
                                "this connection was closed; send the request again",
                                "connection"))

    def _reject(self, msg: m.Rejected) -> None:
        """Send a rejection and count it (by code, for the metrics)."""
        self.rejected.append(msg.code)
        self.outgoing.append(msg)

    def after_message(self) -> None:
        if self.outgoing:
            messages, self.outgoing = self.outgoing, []
            self.sink.send(self.connection, messages)
        if self.records or self.rejected:
            records, rejected = tuple(self.records), tuple(self.rejected)
            self.records, self.rejected = [], []
            if self.usage is not None:
                self.usage.put(am.Ended(records, rejected))


def _merge(chunks: deque[m.Chunk]) -> m.Chunk:
    if len(chunks) == 1:
        return chunks[0]
    first = chunks[0]
    logprobs = None
    if any(c.logprobs is not None for c in chunks):  # the held text released at the end has none
        logprobs = tuple(lp for c in chunks for lp in c.logprobs or ())
    return m.Chunk(
        first.request_id,
        "".join(c.text for c in chunks),
        tuple(t for c in chunks for t in c.token_ids),
        logprobs,
    )
