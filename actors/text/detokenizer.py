"""Turning a growing list of token ids into text deltas that are safe to send.

Safe means: never half of a UTF-8 character, and never any part of a stop string. Text that
could still grow into a stop string is held back until it cannot; a matched stop string and
everything after it is dropped.

Decoding steps as the tokenizers library's `DecodeStream` does. For a byte-level vocabulary
(GPT-2's, SmolLM2's, Llama 3's) the steps run here over each token's bytes (`ByteLevelStream`),
which a test checks against the library step by step; other vocabularies go through the
library, a native call per token.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] | list[str] = ()):
        self._stop = tuple(s for s in stop if s)
        self._by_first_char: dict[str, list[str]] = {}
        for s in self._stop:
            self._by_first_char.setdefault(s[0], []).append(s)
        self._longest_partial = max((len(s) - 1 for s in self._stop), default=0)
        # the tokenizers library's incremental decoder: it re-decodes a few tokens of context
        # so merges at the seam come out right, and holds back an unfinished UTF-8 sequence.
        # A byte-level vocabulary runs the same steps here over the tokens' bytes, without a
        # call into the library per token (a fifth of the daemon's work per token went there)
        vocabulary = getattr(tokenizer, "byte_vocabulary", lambda: None)()
        if vocabulary is not None:
            self._step = ByteLevelStream(vocabulary).step
        else:
            native, backend = DecodeStream(skip_special_tokens=True), tokenizer.backend
            self._step = lambda token: native.step(backend, token)
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
        return self._release(delta)

    def push_one(self, token_id: int) -> str:
        """`push` of one token (a decode step's), with fewer calls."""
        if self.stopped:
            return ""
        delta = self._step(token_id)
        if not delta:
            return ""
        if not self._stop:
            self._released.append(delta)
            return delta
        return self._release(delta)

    def _release(self, delta: str) -> str:
        """What of the held text and `delta` can be sent, given the stop strings."""
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
        step = self._step
        if len(token_ids) == 1:  # a decode step's one token: no generator, no join
            return step(token_ids[0]) or ""
        return "".join(piece for token in token_ids if (piece := step(token)) is not None)

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


class ByteVocabulary:
    """A byte-level vocabulary's tokens as bytes (b"" for a special token, which decoding
    skips), and the text of each that is a whole UTF-8 text on its own (None for the others:
    part of a character, a special token, or text ending in U+FFFD)."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = pieces
        self.texts: list[str | None] = []
        for piece in pieces:
            try:
                text = piece.decode("utf-8")
            except UnicodeDecodeError:
                text = ""
            self.texts.append(text if text and not text.endswith("\ufffd") else None)


class ByteLevelStream:
    """The tokenizers library's `DecodeStream` (skipping special tokens) for a byte-level
    vocabulary (`Tokenizer.byte_vocabulary`).

    The same steps: decode the tokens since the seam; when that text is longer than the seam's
    own text and does not end in U+FFFD (an unfinished UTF-8 sequence), return the new part,
    and move the seam to where the previous step's text began. Decoding a run of tokens of
    such a vocabulary is reading their joined bytes as UTF-8 with replacement. In the steady
    state (the seam's one token is whole text) a token that is whole text on its own is that
    text, which is the step taken without decoding anything."""

    def __init__(self, vocabulary: ByteVocabulary):
        self._pieces_of = vocabulary.pieces
        self._texts = vocabulary.texts
        self._pieces: list[bytes] = []  # the bytes of each token since the seam
        self._prefix = ""  # the text of the tokens before the last step's
        self._prefix_index = 0
        self._steady = False  # one token since the seam, whole text, and the prefix is its

    def step(self, token_id: int) -> str | None:
        text = self._texts[token_id]
        if text is not None and self._steady:
            self._pieces[0] = self._pieces_of[token_id]
            self._prefix = text
            return text
        pieces = self._pieces
        pieces.append(self._pieces_of[token_id])
        text = b"".join(pieces).decode("utf-8", "replace")
        prefix = self._prefix
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            self._steady = False
            return None
        if not text.startswith(prefix):  # as the library's InvalidPrefix
            raise ValueError("the decoded text no longer starts with what was sent")
        index = self._prefix_index
        self._prefix_index = len(pieces) - index
        del pieces[:index]
        self._prefix = b"".join(pieces).decode("utf-8", "replace")
        self._steady = (len(pieces) == 1 and self._prefix_index == 1
                        and "\ufffd" not in self._prefix)
        return text[len(prefix):]
