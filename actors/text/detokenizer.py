"""Turning a growing list of token ids into text deltas that are safe to send.

Safe means: never half of a UTF-8 character, and never any part of a stop string. Text that
could still grow into a stop string is held back until it cannot; a matched stop string and
everything after it is dropped.
"""

from __future__ import annotations

# how many already-decoded tokens to re-decode as context, so merges at the seam come out right
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] | list[str] = ()):
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the re-decoded context window
        self._read_offset = 0  # tokens before this are already turned into text
        self._held = ""  # decoded text not sent yet because it may start a stop string
        self.stopped = False
        self.text = ""  # everything returned so far

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text that can be sent now."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        delta = self._decode_new()
        if not delta:
            return ""
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
        self.text += text
        return text

    def _decode_new(self) -> str:
        decode = self._tokenizer.decode
        context = decode(self._ids[self._prefix_offset:self._read_offset])
        full = decode(self._ids[self._prefix_offset:])
        # a trailing replacement char means an unfinished UTF-8 sequence: wait for more bytes
        if len(full) <= len(context) or full.endswith("\ufffd"):
            return ""
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - _CONTEXT_TOKENS)
        return full[len(context):]

    def _first_stop(self, buffer: str) -> int | None:
        positions = [i for i in (buffer.find(s) for s in self._stop) if i >= 0]
        return min(positions) if positions else None

    def _partial_stop_suffix(self, buffer: str) -> int:
        """Length of the longest buffer suffix that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:k]):
                    longest = k
                    break
        return longest
