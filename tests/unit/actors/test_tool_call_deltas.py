"""The streamed `<tool_call>` parser (`openai_api.ToolCalls`) gives the same content and calls
however the model's text is cut into deltas, a long block included: a call whose arguments
run to megabytes, streamed a character at a time at its end, is parsed as it is whole. Each
delta is searched once, so the long block's last characters cost what they are, not the
length of the block each (a parser that rescanned the block per delta would run for minutes
here)."""

from __future__ import annotations

import json
import random

from sluice.actors.http import openai_api as api


def parsed(pieces, one: bool = False) -> list[tuple[str, object]]:
    """The parts, with adjacent content merged and each call's fresh id left out."""
    parser = api.ToolCalls(one)
    parts = [part for piece in pieces for part in parser.feed(piece)] + parser.end()
    merged: list[tuple[str, object]] = []
    for kind, part in parts:
        if kind == "content":
            assert part, "an empty content part"
            if merged and merged[-1][0] == "content":
                merged[-1] = ("content", merged[-1][1] + part)
                continue
            merged.append((kind, part))
        else:
            assert part["id"].startswith("call_") and part["type"] == "function"
            merged.append((kind, (part["function"]["name"],
                                  json.loads(part["function"]["arguments"]))))
    return merged


def call(name: str, arguments: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_a_long_block_a_character_at_a_time_is_the_whole_block() -> None:
    note = "</tool_call <tool_call </tool_cal> " * 300 + "x" * 5000
    text = ("Sure. " + call("write", {"path": "a.txt", "text": note}) + "\n<tool_call>not "
            "JSON " + "y" * 3000 + "</tool_call>" + call("done", {}) + " bye <tool_call>{\"na")
    whole = parsed([text])
    assert whole == [("content", "Sure. "), ("call", ("write", {"path": "a.txt", "text": note})),
                     ("content", "\n<tool_call>not JSON " + "y" * 3000 + "</tool_call>"),
                     ("call", ("done", {})), ("content", ' bye <tool_call>{"na')]
    assert parsed(list(text)) == whole
    cuts = sorted(random.Random(7).sample(range(1, len(text)), 400))
    assert parsed([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]) == whole
    # parallel_tool_calls false: the blocks after the first call are content
    one = parsed(list(text), one=True)
    assert one == parsed([text], one=True)
    assert [kind for kind, _ in one] == ["content", "call", "content"]


def test_the_end_of_a_megabytes_long_block_streams_a_character_at_a_time() -> None:
    big = "z" * (8 << 20)
    text = "Writing it. " + call("write", {"text": big, "more": "w" * 40000}) + " Done."
    cut = len(text) - 40100
    pieces = [text[:cut], *text[cut:]]  # the block's head at once, then its end char by char
    assert parsed(pieces) == [("content", "Writing it. "),
                              ("call", ("write", {"text": big, "more": "w" * 40000})),
                              ("content", " Done.")]
