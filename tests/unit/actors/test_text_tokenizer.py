"""Long texts take the tokenizer's GIL-releasing path; they must tokenize exactly as before."""

from __future__ import annotations

from sluice.actors.text.tokenizer import _RELEASE_GIL_CHARS


def test_a_long_text_gets_the_same_ids_on_either_path(smollm_tokenizer) -> None:
    text = ("naïve café — 東京タワー 🙂 <|im_end|> 12345 the quick brown fox\n" * 200)
    assert len(text) > _RELEASE_GIL_CHARS
    single = smollm_tokenizer.backend.encode(text, add_special_tokens=False).ids
    assert smollm_tokenizer.encode(text)[-len(single):] == single
    # (a special token's spelling in a message is text: see test_chat_contents.py)
    chat = [{"role": "user", "content": text.replace("<|im_end|>", "")}]
    rendered = smollm_tokenizer.apply_chat_template(chat)
    assert smollm_tokenizer.encode_chat(chat) == smollm_tokenizer.backend.encode(
        rendered, add_special_tokens=False).ids
