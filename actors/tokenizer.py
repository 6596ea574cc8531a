"""The Tokenizer actor: text in, token ids to the Scheduler; token ids out, safe text deltas.

Inbound it validates what the codec could not (exactly one prompt form, sampling ranges,
token ids inside the vocabulary), renders chat messages with the model's template and
tokenizes, off the trio thread when the prompt is long. Outbound it keeps one incremental
detokenizer per request, so a chunk never splits a UTF-8 character and a stop string is held
back until it can no longer match and is never sent; a matched stop string ends the request.

A crash fails the request whose message was being handled (it ends with `Error`); each
other request's detokenizer belongs to that request, was not being touched, and is handed to
the restarted actor, so those requests continue. Outputs of a step that were not handled yet
when the crash happened are handled first by the new incarnation.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import structlog
import trio

from sluice.actors.base import Actor, Handler, Inbox, Outboxes
from sluice.actors.scheduler.plan import InvalidParams, SamplingParams
from sluice.actors.text import IncrementalDetokenizer
from sluice.ipc import messages as m

log = structlog.get_logger("sluice.tokenizer")

FINISH_REASONS = {
    "stop": m.FinishReason.STOP,
    "length": m.FinishReason.LENGTH,
    "cancelled": m.FinishReason.CANCELLED,
    "abort": m.FinishReason.CANCELLED,
    "timeout": m.FinishReason.TIMEOUT,
    "error": m.FinishReason.ERROR,
    "preempted_abort": m.FinishReason.PREEMPTED_ABORT,
    "worker_failed": m.FinishReason.ERROR,
}
ERROR_MESSAGES = {  # what the client's `Error` says, by the scheduler's finish reason
    "worker_failed": "the worker failed: it could not be started; the daemon retries it",
}
LONG_PROMPT_CHARS = 4096  # longer prompts are tokenized in a worker thread


@dataclass
class _Detok:
    client_id: str
    reply_to: str  # the address of its Stream actor's inbox
    detok: IncrementalDetokenizer
    arrival: float
    prompt_tokens: int
    admitted_at: float = 0.0
    first_token_at: float = 0.0
    completion_tokens: int = 0


def sampling_from_wire(wire: m.Sampling) -> SamplingParams:
    """The scheduler's parameters from the client's; `InvalidParams` names a bad field."""
    return SamplingParams(
        max_tokens=wire.max_tokens,
        temperature=wire.temperature,
        top_p=wire.top_p,
        top_k=wire.top_k,
        min_p=wire.min_p,
        seed=wire.seed,
        stop=wire.stop,
        stop_token_ids=wire.stop_token_ids,
        ignore_eos=wire.ignore_eos,
        repetition_penalty=wire.repetition_penalty,
        presence_penalty=wire.presence_penalty,
        frequency_penalty=wire.frequency_penalty,
    )


def check_prompt_form(msg: m.Generate, vocab_size: int) -> None:
    """Exactly one of prompt, messages, prompt_ids; ids inside the vocabulary."""
    given = [name for name in ("prompt", "messages", "prompt_ids") if getattr(msg, name) is not None]
    if len(given) != 1:
        raise InvalidParams("prompt", "give exactly one of prompt, messages, prompt_ids")
    if msg.prompt is not None and not msg.prompt:
        raise InvalidParams("prompt", "must not be empty")
    if msg.messages is not None and not msg.messages:
        raise InvalidParams("messages", "must not be empty")
    if msg.prompt_ids is not None:
        if not msg.prompt_ids:
            raise InvalidParams("prompt_ids", "must not be empty")
        for i, token in enumerate(msg.prompt_ids):
            if not 0 <= token < vocab_size:
                raise InvalidParams(f"prompt_ids[{i}]", f"token {token} is outside the vocabulary")
    for seq_name in ("stop_token_ids",):
        for i, token in enumerate(getattr(msg.sampling, seq_name)):
            if not 0 <= token < vocab_size:
                raise InvalidParams(f"sampling.{seq_name}[{i}]", "outside the vocabulary")


class Tokenizer(Actor):
    name = "tokenizer"

    def __init__(self, tokenizer, *, scheduler: Inbox):
        super().__init__()
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.requests: dict[str, _Detok] = {}  # survives restarts (see the module docstring)
        self._carry: list = []  # outputs a crashed incarnation left unhandled
        self.streams = Outboxes()  # to the Stream actors of live requests
        self.stream_users: Counter[str] = Counter()  # live requests per stream address
        self.askers = Outboxes()  # whoever asks how many requests are held (drain)

    def reset(self) -> None:
        self.in_hand: m.Encode | None = None  # the request being tokenized, for on_crash
        self.culprit: str | None = None  # the request whose output is being rendered
        self.deliveries: dict[str, list] = {}  # stream address -> messages
        self.unhandled: list = []
        carry, self._carry = self._carry, []
        if carry:
            self._render_all(carry, trio.current_time())

    def close(self) -> None:
        super().close()
        self.streams.close()
        self.askers.close()

    def handlers(self) -> dict[type, Handler]:
        return {
            m.Encode: self.on_encode,
            m.Admitted: self.on_admitted,
            m.Refused: self.on_refused,
            m.StepOutputs: self.on_step_outputs,
            m.Ask: self.on_ask,
        }

    async def on_ask(self, msg: m.Ask) -> None:
        """Drain asks until nothing is held: every Encode before the question is handled."""
        self.askers.put(msg.reply_to, m.Reply(msg.token, m.Held(len(self.requests))))

    async def on_encode(self, msg: m.Encode) -> None:
        self.in_hand = msg
        request = msg.generate
        try:
            check_prompt_form(request, self.tokenizer.vocab_size)
            sampling = sampling_from_wire(request.sampling)
            prompt_ids = await self._tokenize(request)
            if not prompt_ids:
                raise InvalidParams("prompt", "tokenizes to nothing")
        except InvalidParams as exc:
            field = exc.field if exc.field.startswith(("prompt", "messages", "sampling")) else (
                f"sampling.{exc.field}"
            )
            self._deliver_one(msg.reply_to, m.Rejected(
                request.request_id, m.RejectCode.INVALID, str(exc), field))
            self.in_hand = None
            return
        self.requests[msg.request_id] = _Detok(
            request.request_id, msg.reply_to,
            IncrementalDetokenizer(self.tokenizer, stop=sampling.stop),
            msg.arrival, len(prompt_ids),
        )
        self.stream_users[msg.reply_to] += 1
        self.in_hand = None
        self.scheduler.put(m.Admit(msg.request_id, msg.connection, tuple(prompt_ids), sampling,
                                   request.priority, request.tenant, msg.arrival))

    async def _tokenize(self, request: m.Generate) -> list[int]:
        if request.prompt_ids is not None:
            return list(request.prompt_ids)
        if request.messages is not None:
            chat = [{"role": c.role, "content": c.content} for c in request.messages]
            size = sum(len(c.content) for c in request.messages)
            work = lambda: self.tokenizer.encode_chat(chat)  # noqa: E731
        else:
            size = len(request.prompt)
            work = lambda: self.tokenizer.encode(request.prompt)  # noqa: E731
        if size > LONG_PROMPT_CHARS:
            return await trio.to_thread.run_sync(work)
        return work()

    async def on_admitted(self, msg: m.Admitted) -> None:
        state = self.requests.get(msg.request_id)
        if state is not None:
            state.admitted_at = trio.current_time()
            self._deliver_one(state.reply_to, m.Accepted(state.client_id, msg.prompt_tokens))

    async def on_refused(self, msg: m.Refused) -> None:
        state = self._end(msg.request_id)
        if state is not None:
            self._deliver_one(state.reply_to, m.Rejected(state.client_id, msg.code, msg.message,
                                                         msg.field))

    async def on_step_outputs(self, msg: m.StepOutputs) -> None:
        self._render_all(list(msg.outputs), trio.current_time())

    def _render_all(self, outputs: list, now: float) -> None:
        self.unhandled = outputs
        while self.unhandled:
            out = self.unhandled[0]
            state = self.requests.get(out.request_id)
            if state is not None:
                self.culprit = out.request_id
                self._render(out, state, self._outbox(state.reply_to), now)
                self.culprit = None
            self.unhandled.pop(0)
        self._deliver()

    def _outbox(self, reply_to: str) -> list:
        return self.deliveries.setdefault(reply_to, [])

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
            self.streams.put(address, m.Deliver(tuple(items)))
            if self.stream_users[address] <= 0:  # its last request ended: hang up
                del self.stream_users[address]
                self.streams.forget(address)

    def _render(self, out, state: _Detok, sent: list, now: float) -> None:
        if out.new_token_ids:
            if not state.first_token_at:
                state.first_token_at = now
            state.completion_tokens += len(out.new_token_ids)
            text = state.detok.push(out.new_token_ids)
            logprobs = None
            if out.logprobs:
                logprobs = tuple(float(t.logprob or 0.0) for t in out.logprobs)
            sent.append(m.Chunk(state.client_id, text, tuple(out.new_token_ids), logprobs))
            if state.detok.stopped:
                self.scheduler.put(m.Finish(out.request_id))
                sent.append(self._finished(out, state, m.FinishReason.STOP, now))
                self._end(out.request_id)
                return
        if out.finished:
            reason = FINISH_REASONS.get(out.finish_reason or "", m.FinishReason.ERROR)
            if reason in (m.FinishReason.STOP, m.FinishReason.LENGTH):
                rest = state.detok.flush()
                if rest:
                    sent.append(m.Chunk(state.client_id, rest, ()))
            elif reason is m.FinishReason.ERROR:
                sent.append(m.Error(state.client_id, ERROR_MESSAGES.get(
                    out.finish_reason, "the request failed in the daemon")))
            sent.append(self._finished(out, state, reason, now))
            self._end(out.request_id)

    def _finished(self, out, state: _Detok, reason: m.FinishReason, now: float) -> m.Finished:
        usage = m.Usage(
            prompt_tokens=state.prompt_tokens,
            completion_tokens=state.completion_tokens,
            cached_tokens=int(getattr(out, "cached_tokens", 0) or 0),
            recomputed_tokens=int(getattr(out, "recomputed_tokens", 0) or 0),
        )
        timings = m.Timings(
            queued=max(0.0, state.admitted_at - state.arrival) if state.admitted_at else 0.0,
            first_token=max(0.0, state.first_token_at - state.arrival) if state.first_token_at else 0.0,
            total=max(0.0, now - state.arrival),
        )
        return m.Finished(state.client_id, reason, usage, timings)

    async def on_crash(self, exc: BaseException) -> None:
        why = f"tokenizer failed: {type(exc).__name__}"
        hand, self.in_hand = self.in_hand, None
        culprit = self.culprit or (hand.request_id if hand is not None else None)
        failed = self._end(culprit) if culprit else None
        if failed is not None:
            self._outbox(failed.reply_to).extend((
                m.Error(failed.client_id, why), m.Finished(failed.client_id, m.FinishReason.ERROR)
            ))
            self.scheduler.put(m.Release((culprit,), m.FinishReason.ERROR))
        elif hand is not None:  # crashed before the request reached the scheduler
            self._outbox(hand.reply_to).extend((
                m.Error(hand.generate.request_id, why),
                m.Finished(hand.generate.request_id, m.FinishReason.ERROR),
            ))
        self._deliver()
        self._carry = self.unhandled[1:]  # [0] is the output that crashed
        log.error("tokenizer crashed", error=repr(exc), request=culprit)
