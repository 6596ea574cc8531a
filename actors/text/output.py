"""One request's output as its client sees it: text deltas, stop strings, usage, logprobs.

The daemon's Tokenizer actor and the in-process `Engine` both render a request through one
`RequestText`, so they cannot disagree on where a stop string ends the text, what held-back
text is released at the end, or how tokens are counted.
"""

from __future__ import annotations

from sluice.actors.text.detokenizer import IncrementalDetokenizer
from sluice.ipc.messages import TokenLogprobs, TopLogprob, Usage
from sluice.ipc.vocabulary import FinishReason

# the ends after which text held back (a possible start of a stop string) is the client's;
# a cancelled or failed request ends where its last delta ended
RELEASES_HELD_TEXT = frozenset((FinishReason.STOP, FinishReason.LENGTH))


class RequestText:
    def __init__(self, tokenizer, stop: tuple[str, ...] | list[str], prompt_tokens: int):
        self._tokenizer = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer, stop)
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.stopped = False  # a stop string ended the text: the request must end now, as `stop`

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self._detok.text

    def push(self, token_ids: list[int] | tuple[int, ...]) -> str:
        """One step's tokens (all are counted, even past a stop string); the text to send."""
        self.completion_tokens += len(token_ids)
        detok = self._detok
        text = detok.push(token_ids)
        self.stopped = detok.stopped
        return text

    def push_one(self, token_id: int) -> str:
        """`push` of one token, the common case, without building a sequence for it."""
        self.completion_tokens += 1
        detok = self._detok
        text = detok.push_one(token_id)
        self.stopped = detok.stopped
        return text

    def end(self, reason: FinishReason | None) -> str:
        """The request ended for `reason`: the held-back text it releases ("" if none)."""
        return self._detok.flush() if reason in RELEASES_HELD_TEXT else ""

    def usage(self, cached_tokens: int = 0, recomputed_tokens: int = 0) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     cached_tokens=cached_tokens, recomputed_tokens=recomputed_tokens)

    def logprobs(self, sampled) -> tuple[TokenLogprobs, ...]:
        """The client's form of one step's `SampledToken`s: each with its text, and its
        alternatives with theirs. A worker that reports no value (the null executor's fixed
        cycle) has its token taken as certain."""
        text = self._tokenizer.token_text
        return tuple(
            TokenLogprobs(text(t.token_id), 0.0 if t.logprob is None else float(t.logprob),
                          tuple(TopLogprob(i, text(i), float(lp)) for i, lp in t.top_logprobs or ()))
            for t in sampled)
