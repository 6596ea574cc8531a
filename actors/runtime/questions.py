"""Asking an actor about its state: send a question by message, wait for its `Reply`.

How anything outside an actor learns its state — the Control actor, the daemon's boot and
drain, the HTTP front's `/health`, the metrics and systemd's `STATUS=`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import trio

from sluice.actors.runtime.base import Inbox, Outbox


class Questions:
    """Ask actors questions and wait for their `Reply`: one reply inbox, answers by token.

    `take_replies` must run (in some nursery) for `ask` to get answers."""

    def __init__(self, name: str):
        self.replies = Inbox(name)
        self._tokens = itertools.count(1)
        self._answers: dict[int, list] = {}  # token -> [] until the answer is in it
        self._answered: trio.Event | None = None

    def _event(self) -> trio.Event:
        if self._answered is None:
            self._answered = trio.Event()
        return self._answered

    async def take_replies(self) -> None:
        while True:
            reply = await self.replies.get()
            waiting = self._answers.get(reply.token)
            if waiting is not None:  # else the question timed out, or predates a restart
                waiting.append(reply.message)
                self._event().set()
                self._answered = trio.Event()

    async def ask(self, actor: Outbox, question: Callable[[str, int], object],
                  timeout: float = 10.0) -> object:
        """Send `question(reply_address, token)` to an actor and wait for its answer."""
        token = next(self._tokens)
        answer = self._answers[token] = []
        actor.put(question(self.replies.address, token))
        try:
            with trio.fail_after(timeout):
                while not answer:
                    await self._event().wait()
        finally:
            del self._answers[token]
        return answer[0]

    def close(self) -> None:
        self.replies.close()
