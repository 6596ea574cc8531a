"""Streaming text: no split characters, no part of a stop string ever sent."""

from __future__ import annotations

from sluice.actors.text import IncrementalDetokenizer, RequestText
from sluice.ipc.messages import FinishReason


def stream(tokenizer, text: str, stop=()):
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces = [detok.push([token]) for token in tokenizer.encode(text)]
    pieces.append(detok.flush())
    return pieces, detok


def test_multibyte_characters_never_break_across_chunks(smollm_tokenizer):
    text = "naïve café — 東京タワー 🙂🚀 ünïcödé"
    ids = smollm_tokenizer.encode(text)
    assert len(ids) > len(text.split())  # some characters span several tokens
    pieces, _ = stream(smollm_tokenizer, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_a_stop_string_split_across_tokens_is_never_sent(smollm_tokenizer):
    text = "alpha beta<|STOP|>gamma delta"
    pieces, detok = stream(smollm_tokenizer, text, stop=("<|STOP|>",))
    sent = "".join(pieces)
    assert detok.stopped
    assert sent == "alpha beta"
    assert not any(ch in piece for piece in pieces for ch in "<|")


def test_text_that_only_looks_like_a_stop_prefix_is_released(smollm_tokenizer):
    pieces, detok = stream(smollm_tokenizer, "a <b and <c end", stop=("<stop>",))
    assert not detok.stopped
    assert "".join(pieces) == "a <b and <c end"


def test_earliest_of_several_stop_strings_wins(smollm_tokenizer):
    pieces, detok = stream(smollm_tokenizer, "one two three four", stop=("four", "two"))
    assert detok.stopped and "".join(pieces) == "one "


def test_held_back_text_is_released_only_when_the_request_ends_by_stop_or_length(
        smollm_tokenizer):
    ids = smollm_tokenizer.encode("alpha beta <|ST")  # ends in what could start the stop
    for reason, released in ((FinishReason.LENGTH, True), (FinishReason.STOP, True),
                             (FinishReason.CANCELLED, False), (FinishReason.ERROR, False),
                             (FinishReason.TIMEOUT, False)):
        text = RequestText(smollm_tokenizer, ("<|STOP|>",), prompt_tokens=5)
        sent = text.push(ids)
        assert not text.stopped and "<|" not in sent
        rest = text.end(reason)
        assert (sent + rest == "alpha beta <|ST") is released
        assert rest == "" or released
        usage = text.usage(cached_tokens=2)
        assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (5, len(ids), 2)
