"""Streaming text: no split characters, no part of a stop string ever sent."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders
from tokenizers.decoders import DecodeStream

from sluice.actors.text import IncrementalDetokenizer, RequestText
from sluice.actors.text.detokenizer import ByteLevelStream
from sluice.ipc.vocabulary import FinishReason


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


def test_the_vocabulary_is_streamed_from_its_bytes(smollm_tokenizer):
    """SmolLM2's vocabulary is byte-level, so text streams from each token's bytes (no call
    into the tokenizers library per token); the bytes of every token alone decode as the
    library decodes it, and special tokens are skipped."""
    vocabulary = smollm_tokenizer.byte_vocabulary()
    assert vocabulary is not None
    assert len(vocabulary.pieces) == smollm_tokenizer.vocab_size
    eos = next(iter(smollm_tokenizer.eos_token_ids))
    assert vocabulary.pieces[eos] == b"" and vocabulary.texts[eos] is None
    word = smollm_tokenizer.encode(" hello")[0]
    assert vocabulary.texts[word] == " hello"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_streaming_from_bytes_steps_exactly_as_the_library_does(smollm_tokenizer, data):
    """Step by step, the same text (or the same None) as the tokenizers library's DecodeStream,
    over runs of tokens mixing whole words, parts of multibyte characters, special tokens and
    text in many scripts."""
    vocabulary = smollm_tokenizer.byte_vocabulary()
    partial = [i for i, text in enumerate(vocabulary.texts) if text is None and vocabulary.pieces[i]]
    special = [i for i, piece in enumerate(vocabulary.pieces) if not piece]
    words = smollm_tokenizer.encode("héllo wörld — 你好，世界 🙂🙃 naïve café\n\tx")
    token = st.one_of(st.integers(0, smollm_tokenizer.vocab_size - 1), st.sampled_from(partial),
                      st.sampled_from(special), st.sampled_from(words))
    ids = data.draw(st.lists(token, min_size=1, max_size=40))
    library = DecodeStream(skip_special_tokens=True)
    ours = ByteLevelStream(vocabulary)
    for token_id in ids:
        assert ours.step(token_id) == library.step(smollm_tokenizer.backend, token_id), ids


def test_a_tokenizer_whose_vocabulary_is_not_byte_level_streams_through_the_library(
        smollm_tokenizer):
    """A decoder other than byte-level (a sentencepiece vocabulary's) gets no byte table; the
    detokenizer then steps through the library's DecodeStream, with the same text."""
    backend = Tokenizer.from_str(smollm_tokenizer.backend.to_str())
    backend.decoder = decoders.Metaspace()
    other = type(smollm_tokenizer)(backend, eos_token_ids=smollm_tokenizer.eos_token_ids)
    assert other.byte_vocabulary() is None
    ids = smollm_tokenizer.encode("plain words here")
    detok = IncrementalDetokenizer(other, ())
    assert "".join(detok.push([i]) for i in ids) == backend.decode(ids)
