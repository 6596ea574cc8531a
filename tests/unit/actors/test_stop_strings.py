"""Stop strings in a stream of text: what is sent and what is held back, checked against the
plain definition on text made of few letters (where stop strings overlap often)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.actors.text import IncrementalDetokenizer

letters = st.text(alphabet="ab<", min_size=1, max_size=12)


def expected(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    """The plain definition: generation stops at the first piece that completes a stop string;
    the text is everything before the earliest stop string complete by then, and whether one
    came. (A longer stop string that began earlier but would complete only with a later piece
    does not count: nothing is generated after a stop.)"""
    text = ""
    for piece in pieces:
        text += piece
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            return text[:min(found)], True
    return text, False


class TextPieces(IncrementalDetokenizer):
    """The detokenizer fed decoded text directly, one piece per 'token'."""

    def __init__(self, stops: list[str]):
        super().__init__(_NoBackend(), stop=stops)
        self._pieces: list[str] = []

    def _decode_new(self, token_ids: list[int]) -> str:
        return "".join(self._pieces[i] for i in token_ids)


class _NoBackend:
    backend = None


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(st.text(alphabet="ab<", max_size=4), min_size=1, max_size=12),
       stops=st.lists(letters, max_size=5))
def test_sent_text_is_what_comes_before_the_first_stop_string(pieces, stops) -> None:
    detok = TextPieces(stops)
    detok._pieces = pieces
    sent = []
    for i in range(len(pieces)):
        sent.append(detok.push([i]))
        # what was sent so far can never be the start of a stop string's match
        so_far = "".join(sent)
        assert not any(stop in so_far for stop in stops)
    sent.append(detok.flush())
    assert ("".join(sent), detok.stopped) == expected(pieces, stops)
