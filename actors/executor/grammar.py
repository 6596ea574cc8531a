"""Constrained decoding: the grammar a request's output must follow, as a token mask per step.

The engine is llguidance. It builds a grammar's parser lazily, token by token (a JSON schema
is ready in about a millisecond, where an ahead-of-time compiler takes tens), bounds the
work of every step by its own fuel limits (so a hostile grammar fails, it does not stall),
and computes the masks of a whole batch on its own threads without the GIL.

A request names its grammar by `SamplingParams.grammar_kind` and `.grammar` (its source:
a JSON schema's text, a regular expression, a JSON list of choices, or a Lark grammar).
`grammar_source` turns one into llguidance's grammar and `check` says what is wrong with
one, with no tokenizer: the fronts have it called in a separate process (`serve_checks`, which
they can kill when a check runs past its time limit), before a request is sent on.
`Constraints` is the worker's side: each grammar the scheduler asks for built on a thread
beside the steps (the request waits in the queue until then), then one matcher per
constrained request, advanced with each token the request is sampled. The plan carries the end of a constrained request's output
(its last token) while the worker has its matcher, and all of it where the matcher must be
rebuilt: after a preemption and recompute, in a worker that restarted and never saw the
request, or for one not planned for a while (see `plan.MATCHER_STEPS`).

Nothing here imports torch: the fronts use `check`, and the sampler applies the masks.
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from collections.abc import Iterable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance

# (the worker's plan module is imported by `Constraints` only: a checking process imports
# this module and llguidance, nothing of the scheduler)

# JSON written compactly: a flexible whitespace lets a small model spend its tokens on
# newlines forever, and a compact object is what a client parses anyway
_JSON_OPTIONS = {"whitespace_flexible": False}
DEFAULT_CACHED_GRAMMARS = 64


class GrammarError(ValueError):
    """A grammar llguidance cannot take: the message says why."""


def limits() -> llguidance.LLParserLimits:
    """The parser's limits for every grammar (llguidance's defaults, which bound a step's
    work to milliseconds)."""
    return llguidance.LLParserLimits()


def grammar_source(kind: str, text: str) -> str:
    """llguidance's grammar for a request's (`grammar_kind`, `grammar`)."""
    try:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            choices = json.loads(text)
            if (not isinstance(choices, list) or not choices
                    or not all(isinstance(c, str) and c for c in choices)):
                raise GrammarError("choices must be a non-empty list of non-empty strings")
            # Lark string literals read JSON's escapes
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices))
        if kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(text)
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        if isinstance(exc, GrammarError):
            raise
        raise GrammarError(str(exc)) from None
    raise GrammarError(f"unknown grammar kind {kind!r}")


def check(kind: str, text: str) -> None:
    """Raise `GrammarError` saying what is wrong with a grammar, before any request uses it.
    May take up to a grammar's build time (bounded by `limits`): call it off an event loop."""
    source = grammar_source(kind, text)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        source, None, limits=limits())
    if is_error:
        raise GrammarError(_first_line(messages[0] if messages else ""))


def check_error(kind: str, text: str) -> str:
    """What is wrong with a grammar, "" when nothing is."""
    try:
        check(kind, text)
    except GrammarError as exc:
        return str(exc) or "invalid grammar"
    return ""


# The checking process's protocol, on its stdin and stdout: it writes READY once it can check;
# then each request is a 4-byte little-endian length and that many bytes of JSON [kind, text],
# each answer a length and that many bytes of UTF-8: the grammar's error, empty when it is good.
READY = b"R"


def serve_checks() -> None:
    """Check grammars for a front until stdin ends (see `READY`). A front runs this in a child
    process, one check at a time, and kills the process when a check runs past its limit."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon's Ctrl-C is the daemon's
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    answers.write(READY)
    answers.flush()
    while len(head := requests.read(4)) == 4:
        body = requests.read(int.from_bytes(head, "little"))
        try:
            kind, text = json.loads(body)
            error = check_error(kind, text)
        except Exception as exc:  # noqa: BLE001 - any failure is the grammar's refusal
            error = f"the grammar could not be checked: {type(exc).__name__}: {exc}"
        data = error.encode("utf-8", "replace")
        answers.write(len(data).to_bytes(4, "little") + data)
        answers.flush()


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "invalid grammar"
    return line if len(line) <= 300 else line[:300] + "…"


class GrammarCache:
    """Grammars checked recently, most recent last: a front checks each grammar once."""

    def __init__(self, size: int = DEFAULT_CACHED_GRAMMARS):
        self.size = size
        self._known: OrderedDict[tuple[str, str], str] = OrderedDict()  # -> "" or an error

    def get(self, kind: str, text: str) -> str | None:
        """"" for a grammar found good, its error for one found bad, None for unknown."""
        key = (kind, text)
        found = self._known.get(key)
        if found is not None:
            self._known.move_to_end(key)
        return found

    def put(self, kind: str, text: str, error: str) -> None:
        if self.size <= 0:
            return
        self._known[(kind, text)] = error
        self._known.move_to_end((kind, text))
        while len(self._known) > self.size:
            self._known.popitem(last=False)


@dataclass
class _State:
    matcher: llguidance.LLMatcher
    consumed: int  # output tokens the matcher has taken
    seen_step: int


class Constraints:
    """The worker's matchers, one per constrained request it samples."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int],
                 *, cached_grammars: int = DEFAULT_CACHED_GRAMMARS, threads: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=self.eos_token_ids)
        self.executor = llguidance.LLExecutor(threads)
        self.words = (vocab_size + 31) // 32  # int32 words of one row's bitmask
        self._templates: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._cached = cached_grammars
        # grammars the scheduler asked for, built beside the steps (llguidance lets go of the
        # GIL while it builds): the builds under way by id and by grammar, the ids built since
        # the last result, and the builds that raised, kept for the step of a request that
        # uses them (where a failure is that request's own, see `_fresh`)
        self._builder: ThreadPoolExecutor | None = None
        self._building: dict[int, tuple[str, str]] = {}
        self._futures: dict[tuple[str, str], Future] = {}
        self._built: list[int] = []
        self._failed: OrderedDict[tuple[str, str], BaseException] = OrderedDict()
        self._states: dict[str, _State] = {}
        self._step = 0
        from sluice.actors.scheduler.plan import MATCHER_STEPS

        # a matcher not scheduled for this many steps is dropped: the scheduler sends a
        # request's whole output again (to rebuild it) after fewer
        self.idle_steps = 2 * MATCHER_STEPS

    @classmethod
    def for_model(cls, model_path, **kwargs) -> Constraints:
        from sluice.actors.text.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_path)
        return cls(tokenizer.backend.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids,
                   **kwargs)

    def __len__(self) -> int:
        return len(self._states)

    def build(self, grammars: Iterable[list]) -> None:
        """Start building each grammar `[id, kind, text]` the scheduler asked for (see
        `take_built`); one built already is reported at once."""
        for grammar, kind, text in grammars:
            key = (kind, text)
            if key in self._templates:
                self._built.append(grammar)
                continue
            if key not in self._futures:
                if self._builder is None:
                    self._builder = ThreadPoolExecutor(1, thread_name_prefix="grammar-builds")
                self._futures[key] = self._builder.submit(self._template, kind, text)
            self._building[grammar] = key

    def take_built(self, wait: float = 0.0) -> list[int]:
        """The ids of the grammars built since the last call; with `wait`, when none is, up
        to that many seconds for a build under way to finish."""
        if wait and self._futures and not self._built:
            futures.wait(self._futures.values(), timeout=wait,
                         return_when=futures.FIRST_COMPLETED)
        for key in [key for key, future in self._futures.items() if future.done()]:
            future = self._futures.pop(key)
            failure = future.exception()
            if failure is None:
                self._keep(key, future.result())
            else:  # reported built all the same: its request's own step raises it
                self._failed[key] = failure
                while len(self._failed) > max(1, self._cached):
                    self._failed.popitem(last=False)
        for grammar, key in list(self._building.items()):
            if key not in self._futures:
                del self._building[grammar]
                self._built.append(grammar)
        built, self._built = self._built, []
        return built

    def _template(self, kind: str, text: str) -> llguidance.LLMatcher:
        """A grammar's matcher at its start, to copy for each request."""
        try:
            source = grammar_source(kind, text)
        except GrammarError:  # a grammar nobody checked: one that allows only the end
            source = llguidance.LLMatcher.grammar_from_regex("")
        return llguidance.LLMatcher(self.tokenizer, source, log_level=0, limits=limits())

    def _keep(self, key: tuple[str, str], template: llguidance.LLMatcher) -> None:
        self._templates[key] = template
        self._templates.move_to_end(key)
        while len(self._templates) > max(1, self._cached):
            self._templates.popitem(last=False)

    def _fresh(self, kind: str, text: str) -> llguidance.LLMatcher:
        """A matcher for a request: from its grammar's template, which is built now if the
        scheduler did not ask for it (a recompute in a worker that lacks it), or awaited if
        its build is under way. A build that raised raises here, in the step of a request
        that uses it."""
        key = (kind, text)
        template = self._templates.get(key)
        if template is None:
            failure = self._failed.pop(key, None)
            if failure is not None:
                raise failure
            future = self._futures.pop(key, None)
            template = future.result() if future is not None else self._template(kind, text)
            self._keep(key, template)
        else:
            self._templates.move_to_end(key)
        return template.deep_copy()

    def _state(self, seq) -> _State:
        """The request's matcher, at the token it samples now: it takes the output ids it
        lacks from the end of the output the plan carries, or is rebuilt from all of them."""
        state = self._states.get(seq.request_id)
        wanted = seq.num_generated
        outputs = seq.output_token_ids or []
        first = wanted - len(outputs)  # the index in the output of the first id carried
        if state is None or not first <= state.consumed <= wanted:
            if first != 0:
                raise ValueError(
                    f"request {seq.request_id!r}: its plan carries its output from token "
                    f"{first}, and this worker's matcher of it is "
                    f"{'gone' if state is None else f'at token {state.consumed}'}")
            state = _State(self._fresh(seq.sampling.grammar_kind, seq.sampling.grammar), 0,
                           self._step)
            self._states[seq.request_id] = state
        if state.consumed < wanted:
            # a recomputed or restarted request (its output so far, again), or a token this
            # matcher did not take. Tokens past what the grammar allows leave the matcher in
            # its error state (end only)
            if not state.matcher.is_error():
                state.matcher.consume_tokens(list(outputs[state.consumed - first:]))
            state.consumed = wanted
        state.seen_step = self._step
        return state

    def masks(self, seqs: list) -> tuple[list[int], object] | None:
        """(rows, bitmask int32 [len(rows), words]) for the constrained rows of `seqs` (the
        sequences that sample this step, in order), or None when none is constrained."""
        import numpy as np

        self._step += 1
        rows = [row for row, seq in enumerate(seqs) if seq.sampling.constrained]
        if not rows:
            self._forget_idle()
            return None
        bitmask = np.zeros((len(rows), self.words), dtype=np.int32)
        matchers = []
        for i, row in enumerate(rows):
            matcher = self._state(seqs[row]).matcher
            matchers.append((matcher, i))
        self.executor.unsafe_compute_mask_ptr(matchers, bitmask.ctypes.data, self.words * 4,
                                              len(rows))
        for (matcher, i) in matchers:
            if matcher.is_error() or not bitmask[i].any():
                # nothing allowed (a broken grammar, or output it never allowed): the end only
                bitmask[i] = 0
                for eos in self.eos_token_ids:
                    bitmask.view(np.uint32)[i, eos // 32] |= np.uint32(1 << (eos % 32))
        self._forget_idle()
        return rows, bitmask

    def advance(self, seqs: list, tokens: list[int]) -> None:
        """The sampled token of each constrained sequence, taken by its matcher."""
        for seq, token in zip(seqs, tokens):
            if not seq.sampling.constrained:
                continue
            state = self._states.get(seq.request_id)
            if state is None or state.consumed != seq.num_generated:
                continue
            if not state.matcher.is_error() and not state.matcher.is_stopped():
                state.matcher.consume_token(token)
            state.consumed += 1

    def _forget_idle(self) -> None:
        if self._step % 16:
            return
        idle = [rid for rid, state in self._states.items()
                if self._step - state.seen_step > self.idle_steps]
        for rid in idle:
            del self._states[rid]
