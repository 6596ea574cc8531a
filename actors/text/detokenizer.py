"""Turning a growing list of token ids into text deltas that are safe to send.

Safe means: never half of a UTF-8 character, and never any part of a stop string. Text that
could still grow into a stop string is held back until it cannot; a matched stop string and
everything after it is dropped.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] | list[str] = ()):
        self._backend = tokenizer.backend
        self._stop = tuple(s for s in stop if s)
        self._by_first_char: dict[str, list[str]] = {}
        for s in self._stop:
            self._by_first_char.setdefault(s[0], []).append(s)
        self._longest_partial = max((len(s) - 1 for s in self._stop), default=0)
        # the tokenizers library's own incremental decoder: it re-decodes a few tokens of
        # context so merges at the seam come out right, and holds back an unfinished UTF-8
        # sequence, in one native call per token
        self._stream = DecodeStream(skip_special_tokens=True)
        self._held = ""  # decoded text not sent yet because it may start a stop string
        self.stopped = False
        self._released: list[str] = []  # everything returned so far, joined when asked

    @property
    def text(self) -> str:
        """Everything returned so far."""
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return self._released[0] if self._released else ""

    def push(self, token_ids: list[int] | tuple[int, ...]) -> str:
        """Add tokens; return the text that can be sent now."""
        if self.stopped:
            return ""
        delta = self._decode_new(token_ids)
        if not delta:
            return ""
        if not self._stop:  # nothing is ever held back
            return self._emit(delta)
        buffer = self._held + delta
        match = self._first_stop(buffer)
        if match is not None:
            self.stopped = True
            self._held = ""
            return self._emit(buffer[:match])
        hold = self._partial_stop_suffix(buffer)
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return self._emit(buffer[:len(buffer) - hold])

    def flush(self) -> str:
        """At the end of a request that did not stop on a string: the held-back remainder."""
        if self.stopped:
            return ""
        rest, self._held = self._held, ""
        return self._emit(rest)

    def _emit(self, text: str) -> str:
        # appended, not concatenated: `self.text += text` copied the whole text per token
        if text:
            self._released.append(text)
        return text

    def _decode_new(self, token_ids: list[int] | tuple[int, ...]) -> str:
        step, backend = self._stream.step, self._backend
        if len(token_ids) == 1:  # a decode step's one token: no generator, no join
            return step(backend, token_ids[0]) or ""
        return "".join(piece for token in token_ids if (piece := step(backend, token)) is not None)

    def _first_stop(self, buffer: str) -> int | None:
        positions = [i for i in (buffer.find(s) for s in self._stop) if i >= 0]
        return min(positions) if positions else None

    def _partial_stop_suffix(self, buffer: str) -> int:
        """Length of the longest buffer suffix that is a proper prefix of a stop string."""
        # Starts are tried earliest first (the first hit is the longest), and at each start
        # only the stop strings that begin with its character: trying every length of every
        # stop string cost ~40x the rest of detokenizing a token with sixteen long ones.
        end = len(buffer)
        for start in range(max(0, end - self._longest_partial), end):
            for stop in self._by_first_char.get(buffer[start], ()):
                if len(stop) > end - start and stop.startswith(buffer[start:]):
                    return end - start
        return 0
