"""The Tokenizer actor: text in, token ids to the Scheduler; token ids out, safe text deltas.

Inbound it runs the model-dependent checks of `intake` (exactly one prompt form, token ids
inside the vocabulary; the sampling parameters checked their own ranges as the codec built
them), renders chat messages with the model's template
and tokenizes. A long prompt is tokenized on one of a few worker threads while the actor
goes on rendering everyone's output; the bytes of the prompts handed to those threads and
not yet done are counted, and past `limits.max_pending_prompt_bytes` a new long prompt gets
`Rejected(overloaded)`. Outbound it keeps one incremental
detokenizer per request, so a chunk never splits a UTF-8 character and a stop string is held
back until it can no longer match and is never sent; a matched stop string ends the request.

It is also the one route from a request's Stream to the Scheduler: `Release`,
`PauseDecoding` and `ResumeDecoding` come here in order behind the request's `Encode`, and
so do an operator's cancel and a drain's release past its deadline (`Operate`). A request
still held here (a long prompt on a thread or waiting for one) ends here: its tokenizing is
called off, its bytes are given back and its Stream gets the `Finished`; one admitted has the
message
forwarded to the Scheduler behind its `Admit`, so nothing about a request overtakes it; one
that already ended has its end on the way to the Stream, and the message is dropped.

A request whose own work raises (its tokenizing, its template, the rendering of its output)
ends alone with `Error` and `Finished(error)`, its release goes to the Scheduler, and the
actor goes on: one request's data never restarts it. Any other exception is a crash, which
fails the request whose message was being handled; each other request's detokenizer belongs
to that request, was not being touched, and is handed to the restarted actor, so those
requests continue. Outputs of a step that were not handled yet when the crash happened, and
long prompts whose tokenizing was cut off, are handled first by the new incarnation.

A request's `Finished` is built here from the core's end of it, which carries its cost: a
matched stop string ends the text at once but holds the `Finished` until the Scheduler's end
comes back (`StopMatched`). An `Ending` with that cost goes to the Stream right before the
`Finished`, for the usage record (`actors.usage.records`); for a request its Stream no longer waits
for (`Release.unattended`), the record is made here.

After each message it tells the Scheduler how many messages its inbox still holds
(`reports.Backlog`, when that number moved far enough): the Scheduler paces its steps by it.
"""

from __future__ import annotations

import dataclasses
import json
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog
import trio

from sluice.actors.runtime import messages as am
from sluice.actors.runtime.base import Actor, Handler, Inbox, Outbox, Outboxes
from sluice.actors.front.intake import check_prompt_form, check_prompt_length
from sluice.actors.front.limits import Limits, clip
from sluice.actors.runtime.reports import BacklogGauge
from sluice.actors.scheduler.plan import StepOutputs
from sluice.actors.text import RequestText
from sluice.actors.usage.records import complete, core_points, record, since
from sluice.ipc import messages as m
from sluice.ipc.vocabulary import InvalidParams, SamplingParams

log = structlog.get_logger("sluice.tokenizer")

FAILED_IN_DAEMON = "the request failed in the daemon"  # an ERROR end that says no more
# Longer prompts are tokenized on a worker thread; shorter ones take less time than the
# thread hand-off would.
LONG_PROMPT_BYTES = 4096
# Worker threads tokenizing at once. Each holds a core while it runs; the decode path (this
# actor's own rendering, the scheduler, the streams) needs the rest. Prompts beyond these
# wait, counted against `max_pending_prompt_bytes`.
TOKENIZER_THREADS = 2


def prompt_bytes(request: m.Generate) -> int:
    """UTF-8 bytes of the text that must be tokenized (none for a token-id prompt)."""
    if request.prompt is not None:
        return len(request.prompt.encode())
    if request.messages is not None:
        return (sum(len(c.role.encode()) + len(c.content.encode()) + len(c.tool_calls.encode())
                    for c in request.messages) + len((request.tools or "").encode()))
    return 0


def chat_of(request: m.Generate) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools a chat request gives the template, as transformers has them;
    the JSON texts of tools and calls read here (a ZeroMQ client's may be anything)."""
    chat = []
    for i, c in enumerate(request.messages):
        message: dict = {"role": c.role, "content": c.content}
        if c.tool_calls:
            calls = _json_list(f"messages[{i}].tool_calls", c.tool_calls)
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                        and isinstance(function.get("arguments"), str)):
                    raise InvalidParams(f"messages[{i}].tool_calls[{j}]", "must be an object "
                                        "with function: {name, arguments (a JSON string)}")
            message["tool_calls"] = calls
        if c.tool_call_id:
            message["tool_call_id"] = c.tool_call_id
        chat.append(message)
    tools = None if request.tools is None else _json_list("tools", request.tools)
    return chat, tools


def _json_list(field: str, text: str) -> list:
    try:
        value = json.loads(text)
    except ValueError:
        raise InvalidParams(field, "is not JSON") from None
    if not isinstance(value, list):
        raise InvalidParams(field, "must be a list")
    return value


@dataclass
class _Held:
    """A long prompt handed to the worker threads and not yet admitted."""

    encode: am.Encode
    size: int  # its bytes, counted against `max_pending_prompt_bytes`
    scope: trio.CancelScope  # called off when the request is released meanwhile


@dataclass
class _Detok:
    client_id: str
    reply_to: str  # the address of its Stream actor's inbox
    text: RequestText
    arrival: float  # time.monotonic() when its Stream received it
    prompt_field: str  # what the client sent its prompt as: prompt | messages | prompt_ids
    tokenized: float  # time.monotonic() when its token ids were ready
    usage_id: str
    tenant: str
    # set when its Stream gave it up: when its first token left (0.0: none did)
    unattended: float | None = None


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def wire_field(core_field: str, prompt_field: str) -> str:
    """The field a client sent, for one the scheduler core names in its own terms (the core
    serves the in-process engine too, which takes `prompt_token_ids` and a flat
    `SamplingParams`)."""
    if core_field == "prompt_token_ids":
        return prompt_field
    if core_field in _SAMPLING_FIELDS:
        return f"sampling.{core_field}"
    return core_field


class Tokenizer(Actor):
    name = "tokenizer"

    def __init__(self, tokenizer, *, scheduler: Outbox, limits: Limits = Limits(),
                 usage: Outbox | None = None, max_model_len: int | None = None,
                 inbox: Inbox | None = None):
        super().__init__(inbox=inbox)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len  # the model's context, when known
        self.scheduler = scheduler
        self.usage = usage  # where the records of unattended requests go
        self.limits = limits
        self.requests: dict[str, _Detok] = {}  # survives restarts (see the module docstring)
        self._carry = StepOutputs()  # outputs a crashed incarnation left unhandled
        self._carry_encodes: list[am.Encode] = []  # long prompts it was still holding
        self.thread_slots = trio.CapacityLimiter(TOKENIZER_THREADS)
        self.streams = Outboxes()  # to the Stream actors of live requests
        self.stream_users: Counter[str] = Counter()  # live requests per stream address
        self.askers = Outboxes()  # whoever asks how many requests are held (drain)
        self.backlog = BacklogGauge(self.name)  # this inbox's depth, told to the Scheduler

    def reset(self) -> None:
        self.in_hand: am.Encode | None = None  # the request being tokenized, for on_crash
        self.deliveries: dict[str, am.Delivery] = {}  # stream address -> its next Deliver
        self.records: list = []  # usage records of unattended requests, sent after the message
        self.unhandled = StepOutputs()  # the outputs of the step being rendered
        # ... and the index of the one in hand: a row of its columns, then past them its
        # whole outputs'
        self.handling = 0
        # long prompts handed to worker threads: not yet admitted, their bytes still held
        self.tokenizing: dict[str, _Held] = {}
        self.pending_prompt_bytes = 0
        carry, self._carry = self._carry, StepOutputs()
        if carry:
            self._render_all(carry)

    async def background(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        encodes, self._carry_encodes = self._carry_encodes, []
        for msg in encodes:  # already checked once; only their tokenizing starts over
            self._start_long(msg, prompt_bytes(msg.generate))

    def close(self) -> None:
        super().close()
        self.streams.close()
        self.askers.close()

    def after_message(self) -> None:
        if self.records:
            records, self.records = tuple(self.records), []
            if self.usage is not None:
                self.usage.put(am.Ended(records))
        self.backlog.report(self.inbox.depth, self.scheduler)

    def handlers(self) -> dict[type, Handler]:
        return {
            am.Encode: self.on_encode,
            am.AdmissionRefused: self.on_admission_refused,
            am.StepOutputs: self.on_step_outputs,
            am.Release: self.on_release,
            am.PauseDecoding: self.on_pause_or_resume,
            am.ResumeDecoding: self.on_pause_or_resume,
            am.Ask: self.on_ask,
            am.Operate: self.on_operate,
        }

    async def on_ask(self, msg: am.Ask) -> None:
        """Drain asks until nothing is held: every Encode before the question is handled."""
        self.askers.put(msg.reply_to, am.Reply(msg.token, am.Held(len(self.requests))))

    async def on_encode(self, msg: am.Encode) -> None:
        self.in_hand = msg
        request = msg.generate
        try:
            too_long = (None if self.max_model_len is None
                        else check_prompt_length(request, self.max_model_len))
            if too_long is not None:  # refused by its length, before a look at its ids
                self._deliver_one(msg.reply_to, too_long)
            else:
                check_prompt_form(request, self.tokenizer.vocab_size)
                size = prompt_bytes(request)
                if size > LONG_PROMPT_BYTES:
                    self._start_long(msg, size)
                else:
                    self._admit(msg, self._work(request)())
        except InvalidParams as exc:
            self._reject_invalid(msg, exc)
        except Exception as exc:  # this request's own work failed: it alone ends
            self._fail_encode(msg, exc)
        self.in_hand = None

    def _start_long(self, msg: am.Encode, size: int) -> None:
        """Tokenize on a worker thread while this actor goes on rendering everyone's output."""
        limit = self.limits.max_pending_prompt_bytes
        if self.pending_prompt_bytes + size > limit:
            field = "prompt" if msg.generate.prompt is not None else "messages"
            self._deliver_one(msg.reply_to, m.Rejected(
                msg.generate.request_id, m.RejectCode.OVERLOADED,
                f"prompts waiting to be tokenized would exceed "
                f"limits.max_pending_prompt_bytes = {limit}; retry later", field))
            return
        held = _Held(msg, size, trio.CancelScope())
        self.pending_prompt_bytes += size
        self.tokenizing[msg.request_id] = held
        self._nursery.start_soon(self._tokenize_long, held)

    async def _tokenize_long(self, held: _Held) -> None:
        msg = held.encode
        with held.scope:  # cancelled while it waits for a thread: the thread is not taken
            try:
                prompt_ids = await trio.to_thread.run_sync(self._work(msg.generate),
                                                           limiter=self.thread_slots)
            except InvalidParams as exc:
                if self._take_back(held):
                    self._reject_invalid(msg, exc)
                return
            except Exception as exc:
                if self._take_back(held):  # else released meanwhile: nobody waits for it
                    self._fail_encode(msg, exc)
                return
        if not held.scope.cancelled_caught and self._take_back(held):
            try:
                self._admit(msg, prompt_ids)
            except InvalidParams as exc:
                self._reject_invalid(msg, exc)
            except Exception as exc:
                self._fail_encode(msg, exc)
        # a cancelled task (a crash elsewhere, or shutdown) leaves its entry in `tokenizing`

    def _take_back(self, held: _Held) -> bool:
        """The threads are done with a long prompt: give its bytes back. False when it was
        released meanwhile (its bytes were given back then, and it was answered)."""
        if self.tokenizing.get(held.encode.request_id) is not held:
            return False
        del self.tokenizing[held.encode.request_id]
        self.pending_prompt_bytes -= held.size
        return True

    def _work(self, request: m.Generate) -> Callable[[], list[int]]:
        if request.prompt_ids is not None:
            return lambda: list(request.prompt_ids)
        if request.messages is not None:
            return lambda: self.tokenizer.encode_chat(*chat_of(request))
        return lambda: self.tokenizer.encode(request.prompt)

    def _admit(self, msg: am.Encode, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise InvalidParams("prompt", "tokenizes to nothing")
        request = msg.generate
        sampling = request.sampling
        self.requests[msg.request_id] = _Detok(
            request.request_id, msg.reply_to,
            RequestText(self.tokenizer, sampling.stop, len(prompt_ids)), msg.arrival,
            "prompt_ids" if request.prompt_ids is not None
            else "messages" if request.messages is not None else "prompt",
            time.monotonic(), msg.usage_id, request.tenant,
        )
        self.stream_users[msg.reply_to] += 1
        self.scheduler.put(am.Admit(msg.request_id, msg.connection, tuple(prompt_ids), sampling,
                                   request.priority, request.tenant, msg.arrival,
                                   request.timeout))

    def _reject_invalid(self, msg: am.Encode, exc: InvalidParams) -> None:
        self._deliver_one(msg.reply_to, m.Rejected(
            msg.generate.request_id, m.RejectCode.INVALID, str(exc), exc.field))

    def _fail_encode(self, msg: am.Encode, exc: Exception) -> None:
        """Preparing one request raised: it ends with an error, and nothing else does (what
        failed was that request's own work, not this actor's state, so nothing restarts)."""
        if msg.request_id in self.requests:  # admitted before it failed
            self._fail_request(msg.request_id, exc)
        else:
            client_id = msg.generate.request_id
            self._outbox(msg.reply_to).extend((
                m.Error(client_id, f"tokenizer failed: {type(exc).__name__}"),
                m.Finished(client_id, m.FinishReason.ERROR)))
            log.error("request failed in the tokenizer", error=_fault(exc),
                      request=clip(msg.request_id, self.limits))
        self._deliver()

    def _fail_request(self, rid: str, exc: BaseException) -> None:
        """End an admitted request with an error: `Error` and `Finished(error)` to its
        Stream, and its release to the Scheduler, which frees its KV."""
        failed = self._end(rid)
        if failed is None:
            return
        why = f"tokenizer failed: {type(exc).__name__}"
        self._outbox(failed.reply_to).extend((
            m.Error(failed.client_id, why), m.Finished(failed.client_id, m.FinishReason.ERROR)))
        self.scheduler.put(am.Release((rid,), m.FinishReason.ERROR))
        log.error("request failed in the tokenizer", error=_fault(exc),
                  request=clip(rid, self.limits))

    async def on_admission_refused(self, msg: am.AdmissionRefused) -> None:
        state = self._end(msg.request_id)
        if state is not None:
            self._deliver_one(state.reply_to, m.Rejected(
                state.client_id, msg.code, msg.message, wire_field(msg.field, state.prompt_field),
                msg.retry_after))

    async def on_release(self, msg: am.Release) -> None:
        """End what is held here; forward the rest behind its Admit (see the docstring)."""
        marks = msg.unattended
        forward = []
        for n, rid in enumerate(msg.request_ids):
            mark = None if marks is None else marks[n]
            if self._call_off(rid, msg.reason, mark):
                continue
            state = self.requests.get(rid)
            if state is not None:
                if mark is not None:
                    state.unattended = mark
                forward.append(rid)
        if forward:
            self.scheduler.put(am.Release(tuple(forward), msg.reason))
        self._deliver()

    async def on_operate(self, msg: am.Operate) -> None:
        """An operator's cancel, or a drain's release of everyone past its deadline, passes
        here on its way to the scheduler, so that it reaches a request wherever it is: one
        still tokenizing ends here, the rest are the scheduler's, behind their `Admit`."""
        command = msg.command
        cancelled = m.FinishReason.CANCELLED
        if isinstance(command, m.CancelCommand) and self._call_off(command.request_id,
                                                                   cancelled):
            self._deliver()
            if msg.reply_to:
                self.askers.put(msg.reply_to, am.Reply(msg.token, m.CommandReply(
                    "cancel", True, f"cancelled {command.request_id} while it was tokenized")))
            return
        if isinstance(command, am.ReleaseAll):
            for rid in list(self.tokenizing):
                self._call_off(rid, cancelled)
            self._deliver()
        self.scheduler.put(msg)

    def _call_off(self, rid: str, reason: m.FinishReason,
                  unattended: float | None = None) -> bool:
        """End a request still tokenizing here with `reason`; whether there was one.
        `unattended`: its Stream no longer waits for it (see `Release`)."""
        held = self.tokenizing.pop(rid, None)
        if held is None:
            return False
        self.pending_prompt_bytes -= held.size
        held.scope.cancel()
        encode = held.encode
        finished = m.Finished(encode.generate.request_id, reason)
        if unattended is not None:
            self._record(finished, encode.arrival, encode.usage_id, encode.generate.tenant,
                         None, unattended)
        self._outbox(encode.reply_to).extend((am.Ending(finished.request_id, None), finished))
        return True

    def _record(self, finished: m.Finished, arrival: float, usage_id: str, tenant: str,
                cost, first_token: float) -> None:
        """The usage record of a request whose Stream gave it up."""
        now, wall = time.monotonic(), time.time()
        timings = complete(finished.timings, first_token=since(first_token, arrival),
                           finished=since(now, arrival),
                           completion_tokens=finished.usage.completion_tokens)
        self.records.append(record(
            usage_id=usage_id, client_id=finished.request_id, tenant=tenant,
            reason=finished.reason, usage=finished.usage, timings=timings, cost=cost,
            start=wall - (now - arrival), end=wall, limits=self.limits))

    async def on_pause_or_resume(self, msg: am.PauseDecoding | am.ResumeDecoding) -> None:
        # only an admitted request has chunks to pause for
        if msg.request_id in self.requests:
            self.scheduler.put(msg)

    async def on_step_outputs(self, msg: am.StepOutputs) -> None:
        requests = self.requests
        for rid, prompt_tokens in msg.admitted:  # before any chunk of theirs
            state = requests.get(rid)
            if state is not None:
                self._outbox(state.reply_to).append(m.Accepted(state.client_id, prompt_tokens))
        self._render_all(msg.outputs)

    def _render_all(self, outputs: StepOutputs) -> None:
        """Render a step's outputs; one whose rendering raises ends its own request with an
        error and the rest are rendered (see `_fail_request`)."""
        self.unhandled = outputs
        start = 0
        while True:
            try:
                self._render_from(outputs, start)
                break
            except Exception as exc:
                culprit = self._rendering()
                if culprit is None:
                    raise
                self._fail_request(culprit, exc)
                start = self.handling + 1
        self.unhandled, self.handling = StepOutputs(), 0
        self._deliver()

    def _render_from(self, outputs: StepOutputs, start: int) -> None:
        requests, deliveries = self.requests, self.deliveries
        rids, tokens = outputs.request_ids, outputs.token_ids
        i = start
        try:
            # the columns: requests that go on with one token (the common case, inline)
            for i in range(start, len(rids)):
                rid, token_id = rids[i], tokens[i]
                state = requests.get(rid)
                if state is None:
                    continue
                rendered = state.text
                if rendered.stopped:  # its text ended at a stop string: its end is awaited
                    continue
                sent = deliveries.get(state.reply_to)
                if sent is None:
                    sent = deliveries[state.reply_to] = am.Delivery()
                sent.chunk(state.client_id, rendered.push_one(token_id), (token_id,))
                if rendered.stopped:
                    self.scheduler.put(am.StopMatched(rid))
            whole = outputs.outputs
            for i in range(max(start, len(rids)), len(rids) + len(whole)):
                out = whole[i - len(rids)]
                state = requests.get(out.request_id)
                if state is not None:
                    self._render(out, state, self._outbox(state.reply_to))
        except BaseException:
            self.handling = i  # the output in hand: its request is the one that ends
            raise

    def _outbox(self, reply_to: str) -> am.Delivery:
        sent = self.deliveries.get(reply_to)
        if sent is None:
            sent = self.deliveries[reply_to] = am.Delivery()
        return sent

    def _end(self, request_id: str) -> _Detok | None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.stream_users[state.reply_to] -= 1
        return state

    def _deliver_one(self, reply_to: str, msg: object) -> None:
        self._outbox(reply_to).append(msg)
        self._deliver()

    def _deliver(self) -> None:
        deliveries, self.deliveries = self.deliveries, {}
        for address, items in deliveries.items():
            self.streams.put(address, items.message())
            if self.stream_users[address] <= 0:  # its last request ended: hang up
                del self.stream_users[address]
                self.streams.forget(address)

    def _render(self, out, state: _Detok, sent: am.Delivery) -> None:
        rendered = state.text
        if rendered.stopped:  # its text ended at a stop string: only its end is awaited
            if out.finished:
                self._finish(out, state, m.FinishReason.STOP, sent)
            return
        if out.new_token_ids:
            text = rendered.push(out.new_token_ids)
            logprobs = rendered.logprobs(out.logprobs) if out.logprobs else None
            sent.chunk(state.client_id, text, tuple(out.new_token_ids), logprobs)
            if rendered.stopped:
                if out.finished:  # it ended in the core with this very token
                    self._finish(out, state, m.FinishReason.STOP, sent)
                else:
                    self.scheduler.put(am.StopMatched(out.request_id))
                return
        if out.finished:
            reason = out.finish_reason or m.FinishReason.ERROR
            if rest := state.text.end(reason):
                sent.append(m.Chunk(state.client_id, rest, ()))
            if reason is m.FinishReason.ERROR:
                sent.append(m.Error(state.client_id, out.error or FAILED_IN_DAEMON))
            self._finish(out, state, reason, sent)

    def _finish(self, out, state: _Detok, reason: m.FinishReason, sent: am.Delivery) -> None:
        """The request's end: its `Ending` and `Finished` to the Stream (and its usage record
        made here when the Stream no longer waits for it)."""
        cost = out.cost
        usage = state.text.usage(out.cached_tokens, out.recomputed_tokens)
        timings = m.Timings(tokenized=since(state.tokenized, state.arrival),
                            **core_points(cost, state.arrival))
        finished = m.Finished(state.client_id, reason, usage, timings)
        recorded = state.unattended is not None
        if recorded:
            self._record(finished, state.arrival, state.usage_id, state.tenant, cost,
                         state.unattended)
        sent.extend((am.Ending(state.client_id, cost, recorded), finished))
        self._end(out.request_id)

    def _rendering(self) -> str | None:
        """The request whose output was being rendered when the actor crashed, if any."""
        rids, i = self.unhandled.request_ids, self.handling
        if i >= len(self.unhandled):
            return None
        rid = rids[i] if i < len(rids) else self.unhandled.outputs[i - len(rids)].request_id
        return rid if rid in self.requests else None

    async def on_crash(self, exc: BaseException) -> None:
        why = f"tokenizer failed: {type(exc).__name__}"
        hand, self.in_hand = self.in_hand, None
        culprit = self._rendering() or (hand.request_id if hand is not None else None)
        if culprit in self.requests:
            self._fail_request(culprit, exc)
        elif hand is not None:  # crashed before the request reached the scheduler
            self._outbox(hand.reply_to).extend((
                m.Error(hand.generate.request_id, why),
                m.Finished(hand.generate.request_id, m.FinishReason.ERROR),
            ))
        self._deliver()
        self._carry = _after(self.unhandled, self.handling)  # the one there crashed
        # long prompts cut off mid-tokenizing did nothing wrong: the next incarnation redoes them
        self._carry_encodes = [held.encode for held in self.tokenizing.values()]
        log.error("tokenizer crashed", error=repr(exc),
                  request=clip(culprit, self.limits) if culprit else None)


def _after(outputs: StepOutputs, i: int) -> StepOutputs:
    """The outputs past the `i`th (counted as `_render_from` counts them)."""
    n = len(outputs.request_ids)
    return StepOutputs(outputs.request_ids[i + 1:], outputs.token_ids[i + 1:],
                       outputs.outputs[max(0, i + 1 - n):])


def _fault(exc: BaseException) -> str:
    """An exception as a log line may show it: its type and where it was raised, never its
    message, which may quote the request's prompt or output text."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}{where}"
