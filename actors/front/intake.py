"""Range checks of a client's `Generate`: the one place a request's values are judged.

`check_generate` compares a request with the intake `Limits` and returns the `Rejected` the
client should get (or `None`); the Stream calls it before anything is held for the request.
`GrammarChecks` says whether the engine can follow a request's grammar, in a child process
that is killed when a check runs past its time limit, each sender's checks one at a time: the
HTTP front asks it before a request goes on, and so does a ZeroMQ connection's Stream.
`check_prompt_length` and `check_prompt_form` need the model and are the Tokenizer's to call.
Sampling ranges are checked by `SamplingParams` as the codec builds it; checks that need the
daemon's state belong to the actors that own it. See docs/architecture.md, "A token's path".
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, field

import trio

from sluice.actors.executor import grammar
from sluice.actors.front.limits import Limits, clip
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


class GrammarBusy(Exception):
    """A grammar check refused because its sender has too many waiting: the request may be sent
    again later. `limit` names the limit (the field of a `Rejected`)."""

    def __init__(self, message: str, limit: str):
        super().__init__(message)
        self.limit = limit


# the checking process: this module's interpreter, importing llguidance and nothing else of ours
_CHECKER = "from sluice.actors.executor.grammar import serve_checks; serve_checks()"
_START_SECONDS = 30.0  # a checking process that has not started by then is given up


class _Checker:
    """One process checking grammars one at a time (`grammar.serve_checks`): a check past its
    time limit is ended by killing the process, so nothing of it goes on running."""

    def __init__(self, process: trio.Process):
        self.process = process
        self.buffer = bytearray()

    @classmethod
    async def start(cls) -> _Checker:
        """A process ready to check (it answered `grammar.READY`); OSError if none starts."""
        with trio.CancelScope(shield=True):  # a half-started process is never left behind
            process = await trio.lowlevel.open_process(
                [sys.executable, "-c", _CHECKER], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE)
            checker = cls(process)
            try:
                with trio.fail_after(_START_SECONDS):
                    ready = await checker._read(len(grammar.READY))
            except (OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                await checker.kill()
                raise OSError(f"no process to check grammars could start ({exc})") from None
            if ready != grammar.READY:
                await checker.kill()
                raise OSError("the process started to check grammars said something else")
        return checker

    async def _read(self, size: int) -> bytes:
        while len(self.buffer) < size:
            chunk = await self.process.stdout.receive_some(1 << 16)
            if not chunk:
                raise OSError("the grammar checking process ended")
            self.buffer += chunk
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    async def check(self, kind: str, text: str) -> str:
        """The grammar's error, "" when it is good."""
        body = json.dumps([kind, text]).encode()
        try:
            await self.process.stdin.send_all(len(body).to_bytes(4, "little") + body)
            size = int.from_bytes(await self._read(4), "little")
            return (await self._read(size)).decode("utf-8", "replace")
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise OSError(f"the grammar checking process is gone ({exc})") from None

    async def kill(self) -> None:
        with trio.CancelScope(shield=True):
            self.process.kill()
            for pipe in (self.process.stdin, self.process.stdout):
                await pipe.aclose()
            await self.process.wait()  # reaped

    def close(self) -> None:
        """Kill it without waiting (it is reaped by whoever starts the next subprocess)."""
        self.process.kill()
        for pipe in (self.process.stdin, self.process.stdout):
            pipe.close()


@dataclass(eq=False)
class _Turn:
    """A check waiting for its party's turn and a process."""

    given: trio.Event = field(default_factory=trio.Event)
    checker: _Checker | None = None  # the idle process it is handed, or None: it starts one


@dataclass(eq=False)
class _Pending:
    """A check others with the same grammar wait for."""

    done: trio.Event = field(default_factory=trio.Event)
    answered: bool = False
    error: str | None = None  # its answer: the error, "" for none, None for out of time


class GrammarChecks:
    """Whether the engine can follow a grammar, shared by the daemon's fronts.

    A grammar not seen before is checked in one of `limits.grammar_check_processes` child
    processes, never on the event loop, and within `limits.max_grammar_compile_ms` counted
    from the moment its process starts on it: a check past the limit is a refusal, and its
    process is killed (a thread could only be abandoned, still running and holding its place)
    and a new one started on the sender's time. Checks are taken in turns by *party*, the
    sender as the front tells them apart (a tenant its key proves, else the client: its
    address over HTTP, its connection over ZeroMQ; the label names it in a refusal). A party's
    checks run one at a time, in its order; the parties waiting take the free processes in
    turn. So a party sending slow or hostile grammars holds one process and waits behind
    itself, and another's check waits for no more than one check of each party ahead of it in
    the turn. Past `limits.max_grammar_checks_waiting` of one party's checks waiting, the next
    is refused (`GrammarBusy`); a request whose grammar its party is checking already waits
    for that check and holds no place. Good and bad grammars are remembered
    (`limits.max_cached_grammars`), so each is checked once; one that ran out of time is not,
    as a retry may find it faster."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.known = grammar.GrammarCache(limits.max_cached_grammars)
        self._idle: list[_Checker] = []
        self._processes = 0  # processes checking, idle or being started
        self._running: set[str] = set()  # parties with a check holding a process
        # each party's checks waiting, in its order; the parties in turn order (the first one
        # not running is served next, and goes to the end if it has more waiting)
        self._waiting: dict[str, deque[_Turn]] = {}
        # checks running or waiting, by (party, kind, text): one party's same grammar once
        self._pending: dict[tuple[str, str, str], _Pending] = {}
        self.timed_out = 0  # checks ended at the time limit

    async def problem(self, kind: str, text: str, party: str = "tenant 'default'") -> str:
        """Why a request's grammar is refused, "" when it is not; `GrammarBusy` when `party`
        (see the class) has too many checks waiting. A grammar seen before is answered at
        once, without a checkpoint."""
        error = self.known.get(kind, text)
        if error is None:
            error = await self._shared_check(kind, text, party)
            if error is None:
                return (f"checking the grammar took longer than "
                        f"limits.max_grammar_compile_ms = {self.limits.max_grammar_compile_ms}")
        return f"not a grammar this server can follow: {error}" if error else ""

    def close(self) -> None:
        """Kill the idle checking processes (those checking end with their requests)."""
        while self._idle:
            self._idle.pop().close()
            self._processes -= 1

    async def _shared_check(self, kind: str, text: str, party: str) -> str | None:
        """`_check`'s answer. While one runs, the same party's requests with the same grammar
        wait for its answer, in no queue, rather than check it again (a client's burst of
        requests with one new schema is one check); another party's check its own, so as
        never to wait behind this party's turn."""
        key = (party, kind, text)
        while (pending := self._pending.get(key)) is not None:
            await pending.done.wait()
            if pending.answered:
                return pending.error
            # it ended unanswered (its request gone, or refused as busy): this one tries
            known = self.known.get(kind, text)
            if known is not None:
                return known
        pending = self._pending[key] = _Pending()
        try:
            pending.error = await self._check(kind, text, party)
            pending.answered = True
            return pending.error
        finally:
            del self._pending[key]
            pending.done.set()

    async def _check(self, kind: str, text: str, party: str) -> str | None:
        """The grammar's error ("" for none), or None when its check ran out of time."""
        checker = await self._turn(party)
        try:
            known = self.known.get(kind, text)  # checked while this one waited
            if known is not None:
                return known
            if checker is not None and checker.process.returncode is not None:
                # an idle process that ended (killed from outside): replaced, not blamed
                doomed, checker = checker, None
                await doomed.kill()
            if checker is None:
                checker = await self._start()
            error: str | None = None
            died = False
            with trio.move_on_after(self.limits.max_grammar_compile_ms / 1000):
                try:
                    error = await checker.check(kind, text)
                except OSError:  # the process died on this grammar: the grammar is refused
                    died = True
                    error = "checking it ended the process that checked it"
                finally:
                    # cut short (out of time, or its request cancelled), or dead
                    if error is None or died:
                        doomed, checker = checker, None
                        await doomed.kill()
            if error is None:
                self.timed_out += 1
                try:  # the next process started on this sender's time, not the next one's
                    checker = await _Checker.start()
                except OSError:
                    pass  # the next check starts one
                return None
            self.known.put(kind, text, error)
            return error
        finally:
            self._release(party, checker)

    async def _start(self) -> _Checker:
        try:
            return await _Checker.start()
        except OSError as exc:
            raise GrammarBusy(f"the grammar could not be checked: {exc}",
                              "grammar_check_processes") from None

    async def _turn(self, party: str) -> _Checker | None:
        """Wait for `party`'s turn; then it holds a process: an idle one, or (None) the place
        of one it starts. `_release` gives it back."""
        if party not in self._running and party not in self._waiting and self._free():
            self._running.add(party)
            return self._take()
        queue = self._waiting.get(party)
        waiting = 0 if queue is None else len(queue)
        limit = self.limits.max_grammar_checks_waiting
        if waiting >= limit:
            raise GrammarBusy(
                f"{clip(party, self.limits)} has {waiting} grammar checks waiting, "
                f"limits.max_grammar_checks_waiting = {limit}; send it again later",
                "max_grammar_checks_waiting")
        turn = _Turn()
        self._waiting.setdefault(party, deque()).append(turn)
        try:
            await turn.given.wait()
        except BaseException:
            if turn.given.is_set():  # handed a process as it was cancelled
                self._release(party, turn.checker)
            else:
                queue = self._waiting[party]
                queue.remove(turn)
                if not queue:
                    del self._waiting[party]
            raise
        return turn.checker

    def _free(self) -> bool:
        return bool(self._idle) or self._processes < self.limits.grammar_check_processes

    def _take(self) -> _Checker | None:
        if self._idle:
            return self._idle.pop()
        self._processes += 1
        return None

    def _release(self, party: str, checker: _Checker | None) -> None:
        """`party`'s turn ends; its process goes back (None: it has none, its place is free),
        and the next party's check in the turn takes a process."""
        self._running.discard(party)
        if party in self._waiting:  # its next check goes after those of the others waiting
            self._waiting[party] = self._waiting.pop(party)
        if checker is not None:
            self._idle.append(checker)
        else:
            self._processes -= 1
        while self._free():
            party = next((t for t in self._waiting if t not in self._running), None)
            if party is None:
                return
            queue = self._waiting.pop(party)
            turn = queue.popleft()
            if queue:
                self._waiting[party] = queue  # the end of the turn
            self._running.add(party)
            turn.checker = self._take()
            turn.given.set()


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
