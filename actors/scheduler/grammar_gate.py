"""Which grammars the worker has built: a constrained request is admitted once its grammar is.

A grammar's matcher is built in the worker, from the model's tokenizer: milliseconds for most
JSON schemas, hundreds of them for a large one. Built at the request's first sampling step, it
held that step, and every stream in it, for as long. Instead the core asks for each new grammar
in the next plan it sends (`StepPlan.grammars`, with an id of its own), the worker builds it on
a thread of its own beside its steps and names the ids built in its results
(`StepResult.grammars_built`), and until then the request waits in the queue: `ready` is one of
the tests a tenant's next request must pass to be admitted, so the tenant's later requests wait
behind it, and everyone else's go on. While builds are under way and nothing else runs, the
scheduler sends plans with no sequence, which the worker answers once a build finished or a
short wait passed.

A grammar is known while a live request uses it. A new worker knows none: `reset` asks for
every grammar again. A request requeued to recompute (after a preemption or a lost worker) is
not held back a second time; if its worker lacks the grammar, it builds it at the step that
needs it, as it does for one it dropped from its bounded store.
"""

from __future__ import annotations

from collections.abc import Iterable

from sluice.actors.scheduler.request import Request


class GrammarGate:
    def __init__(self) -> None:
        self._ids: dict[tuple[str, str], int] = {}  # (kind, text) -> its id
        self._keys: dict[int, tuple[str, str]] = {}
        self._users: dict[int, int] = {}  # id -> live requests with that grammar
        self._ready: set[int] = set()
        self._to_ask: list[int] = []  # for the next plan
        self._building: set[int] = set()  # asked for, not yet reported built
        self._next_id = 0

    def add(self, request: Request) -> None:
        """A new request: its grammar is asked for, unless known already."""
        key = _key(request)
        if key is None:
            return
        grammar = self._ids.get(key)
        if grammar is None:
            grammar = self._ids[key] = self._next_id
            self._next_id += 1
            self._keys[grammar] = key
            self._users[grammar] = 0
            self._to_ask.append(grammar)
        self._users[grammar] += 1

    def remove(self, request: Request) -> None:
        """An ended request: a grammar no live request uses is forgotten."""
        key = _key(request)
        grammar = None if key is None else self._ids.get(key)
        if grammar is None:
            return
        self._users[grammar] -= 1
        if self._users[grammar] == 0:
            del self._users[grammar], self._ids[key], self._keys[grammar]
            self._ready.discard(grammar)
            self._building.discard(grammar)
            if grammar in self._to_ask:
                self._to_ask.remove(grammar)

    def ready(self, request: Request) -> bool:
        """May it be admitted: it has no grammar, or the worker has built it, or it is
        recomputing (it was admitted before)."""
        key = _key(request)
        if key is None or request.max_computed_tokens:
            return True
        return self._ids.get(key) in self._ready

    def take_asks(self) -> list[list]:
        """[id, kind, text] of each grammar not asked for yet: for the plan being sent."""
        asks, self._to_ask = self._to_ask, []
        self._building.update(asks)
        return [[grammar, *self._keys[grammar]] for grammar in asks]

    def built(self, grammars: Iterable[int]) -> None:
        """The worker reported these built (ids it was never asked for, or of a grammar
        forgotten since, are ignored)."""
        for grammar in grammars:
            if grammar in self._building:
                self._building.discard(grammar)
                self._ready.add(grammar)

    @property
    def waiting(self) -> bool:
        """Builds asked for, or to ask for, and not reported yet."""
        return bool(self._building or self._to_ask)

    def reset(self) -> None:
        """A new worker, which has built nothing: every grammar in use is asked for again."""
        self._ready.clear()
        self._building.clear()
        self._to_ask = list(self._users)


def _key(request: Request) -> tuple[str, str] | None:
    sampling = request.sampling
    return (sampling.grammar_kind, sampling.grammar) if sampling.constrained else None
