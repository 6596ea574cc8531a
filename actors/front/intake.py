"""Range checks of a client's `Generate`: the one place a request's values are judged.

`check_generate` compares a request with the intake `Limits` and returns the `Rejected` the
client should get (or `None`); the Stream calls it before anything is held for the request.
`GrammarChecks` says whether the engine can follow a request's grammar, on a worker thread:
the HTTP front asks it before a request goes on, and so does a ZeroMQ connection's Stream.
`check_prompt_length` and `check_prompt_form` need the model and are the Tokenizer's to call.
Sampling ranges are checked by `SamplingParams` as the codec builds it; checks that need the
daemon's state belong to the actors that own it. See docs/architecture.md, "A token's path".
"""

from __future__ import annotations

import math

import trio

from sluice.actors.executor import grammar
from sluice.actors.front.limits import Limits
from sluice.ipc import messages as m
from sluice.ipc.vocabulary import INT64_MAX, InvalidParams, shown


def _refuse(msg: m.Generate, code: m.RejectCode, field: str, what: str, limit_name: str,
            limit: int) -> m.Rejected:
    return m.Rejected(msg.request_id, code, f"{what} exceeds limits.{limit_name} = {limit}", field)


def prompt_chars(msg: m.Generate) -> int:
    """Characters of a text prompt, or of all chat messages together (roles and contents)."""
    if msg.prompt is not None:
        return len(msg.prompt)
    if msg.messages is not None:
        # roles count too: the template renders them into the prompt, so a role must not
        # carry what the limit keeps out of the contents
        return sum(len(message.role) + len(message.content) for message in msg.messages)
    return 0


def check_generate(msg: m.Generate, limits: Limits) -> m.Rejected | None:
    """The rejection for the first limit `msg` is over, or None when it is within all."""
    invalid = m.RejectCode.INVALID
    if len(msg.request_id) > limits.max_request_id_chars:
        return _refuse(msg, invalid, "request_id", f"{len(msg.request_id)} characters",
                       "max_request_id_chars", limits.max_request_id_chars)
    if len(msg.tenant) > limits.max_tenant_chars:
        return _refuse(msg, invalid, "tenant", f"{len(msg.tenant)} characters",
                       "max_tenant_chars", limits.max_tenant_chars)
    if msg.messages is not None and len(msg.messages) > limits.max_messages:
        return _refuse(msg, invalid, "messages", f"{len(msg.messages)} messages",
                       "max_messages", limits.max_messages)
    chars = prompt_chars(msg)
    if chars > limits.max_prompt_chars:
        # too long rather than invalid: the same request with a shorter prompt is fine
        field = "prompt" if msg.prompt is not None else "messages"
        return _refuse(msg, m.RejectCode.TOO_LONG, field, f"{chars} prompt characters",
                       "max_prompt_chars", limits.max_prompt_chars)
    if msg.timeout is not None and not 0 < msg.timeout < math.inf:
        return m.Rejected(msg.request_id, invalid, "must be a number of seconds > 0", "timeout")
    if not -INT64_MAX - 1 <= msg.priority <= INT64_MAX:
        return m.Rejected(msg.request_id, invalid, f"must be an integer within 64 bits, got "
                          f"{shown(msg.priority)}", "priority")
    stops = msg.sampling.stop
    if len(stops) > limits.max_stop_strings:
        return _refuse(msg, invalid, "sampling.stop", f"{len(stops)} stop strings",
                       "max_stop_strings", limits.max_stop_strings)
    for i, stop in enumerate(stops):
        if len(stop) > limits.max_stop_string_chars:
            return _refuse(msg, invalid, f"sampling.stop[{i}]", f"{len(stop)} characters",
                           "max_stop_string_chars", limits.max_stop_string_chars)
    sampling = msg.sampling
    if len(sampling.logit_bias_ids) > limits.max_logit_bias:
        return _refuse(msg, invalid, "sampling.logit_bias", f"{len(sampling.logit_bias_ids)} "
                       "entries", "max_logit_bias", limits.max_logit_bias)
    if len(sampling.grammar) > limits.max_grammar_bytes // 4 and (
            len(sampling.grammar.encode()) > limits.max_grammar_bytes):
        return _refuse(msg, invalid, "sampling.grammar", f"{len(sampling.grammar.encode())} "
                       "bytes", "max_grammar_bytes", limits.max_grammar_bytes)
    return None


# grammars checked at once, in the whole daemon: each check holds a core while it runs
GRAMMAR_CHECK_THREADS = 2


def _grammar_error(kind: str, text: str) -> str:
    """What is wrong with a grammar, "" when nothing is (runs on a worker thread)."""
    try:
        grammar.check(kind, text)
    except grammar.GrammarError as exc:
        return str(exc) or "invalid grammar"
    return ""


class GrammarChecks:
    """Whether the engine can follow a grammar, shared by the daemon's fronts. A grammar is
    checked on a worker thread, never on the event loop, by at most `GRAMMAR_CHECK_THREADS` at
    once; a check that runs past `limits.max_grammar_compile_ms` is a refusal (its thread is
    left to finish, and holds its place until it does); good and bad grammars are remembered
    (`limits.max_cached_grammars`), so each is checked once."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.known = grammar.GrammarCache(limits.max_cached_grammars)
        self.threads = trio.CapacityLimiter(GRAMMAR_CHECK_THREADS)

    async def problem(self, kind: str, text: str) -> str:
        """Why a request's grammar is refused, "" when it is not. A grammar seen before is
        answered at once, without a checkpoint."""
        error = self.known.get(kind, text)
        if error is None:
            limit = self.limits.max_grammar_compile_ms
            with trio.move_on_after(limit / 1000) as timer:
                error = await trio.to_thread.run_sync(_grammar_error, kind, text,
                                                      limiter=self.threads,
                                                      abandon_on_cancel=True)
            if timer.cancelled_caught:
                return (f"checking the grammar took longer than "
                        f"limits.max_grammar_compile_ms = {limit}")
            self.known.put(kind, text, error)
        return f"not a grammar this server can follow: {error}" if error else ""


def check_prompt_length(msg: m.Generate, max_model_len: int) -> m.Rejected | None:
    """The rejection of a token-id prompt that leaves no room to generate in the model's
    context, made before anything looks at (or copies) its ids."""
    ids = msg.prompt_ids
    if ids is None or len(ids) + 1 <= max_model_len:
        return None
    return m.Rejected(msg.request_id, m.RejectCode.TOO_LONG,
                      f"prompt_ids: {len(ids)} tokens leave no room to generate within "
                      f"max_model_len {max_model_len}", "prompt_ids")


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
        _check_ids("prompt_ids", msg.prompt_ids, vocab_size)
    _check_ids("sampling.stop_token_ids", msg.sampling.stop_token_ids, vocab_size)
    _check_ids("sampling.logit_bias", msg.sampling.logit_bias_ids, vocab_size)


def _check_ids(field: str, ids: tuple[int, ...], vocab_size: int) -> None:
    # min and max run in C; the loop that names the offending id runs only when one is out
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):
        return
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidParams(f"{field}[{i}]", f"token {shown(token)} is outside the "
                                f"vocabulary (0 to {vocab_size - 1})")
