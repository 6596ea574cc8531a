"""Tool calls through the official `openai` client, on the embedded model (the session's
`model_daemon`): a forced call (`required`, or a named function) sampled at temperature 1 is
a `tool_calls` entry whose arguments validate against the function's parameters; `auto`
answers text or well-formed calls; streamed and whole answers of one seed agree; bad tools
are a 400 naming the field or the limit; a conversation holding a `tool` turn is answered.
The fixture checks the KV invariant after each test."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import trio

from sluice.actors.front.limits import Limits

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 16},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "The weather in a city."}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK,
                                           "description": "The time in a time zone."}}]
PARAMETERS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def client_for(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{daemon.http}/v1", api_key="unused", max_retries=0,
                         timeout=240)


def calls_of(message) -> list[tuple[str, dict]]:
    """(name, arguments) of each well-formed call; fails on a malformed one."""
    found = []
    for call in message.tool_calls or ():
        assert call.type == "function" and call.id.startswith("call_"), call
        assert call.function.name in PARAMETERS, call
        found.append((call.function.name, json.loads(call.function.arguments)))
    return found


def streamed(chunks) -> tuple[str, list[tuple[str, dict]], str]:
    """The content, calls and finish reason a stream of chunks adds up to."""
    content, calls, reason = [], {}, None
    for chunk in chunks:
        choice = chunk.choices[0]
        content.append(choice.delta.content or "")
        for call in choice.delta.tool_calls or ():
            assert call.id.startswith("call_") and call.type == "function", call
            calls[call.index] = (call.function.name, json.loads(call.function.arguments))
        reason = choice.finish_reason or reason
    return "".join(content), [calls[i] for i in sorted(calls)], reason


async def test_forced_tool_calls_validate_and_streams_agree(model_daemon) -> None:
    client = client_for(model_daemon)
    model = (await trio.to_thread.run_sync(client.models.list)).data[0].id
    named = {"type": "function", "function": {"name": "get_time"}}

    def one(args):
        seed, choice = args
        return client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                              tool_choice=choice, max_tokens=64,
                                              temperature=1.0, seed=seed)

    def run():
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(one, [(seed, choice) for seed in range(4)
                                          for choice in ("required", named)]))
        whole = one((7, "required"))
        stream = list(client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=64,
            temperature=1.0, seed=7, stream=True))
        return answers, whole, stream

    with trio.fail_after(240):
        answers, whole, stream = await trio.to_thread.run_sync(run)
    for i, answer in enumerate(answers):
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        calls = calls_of(choice.message)
        assert len(calls) == 1
        name, arguments = calls[0]
        if i % 2:  # the named function, and no other
            assert name == "get_time"
        jsonschema.validate(arguments, PARAMETERS[name])
    content, calls, reason = streamed(stream)
    assert reason == "tool_calls" == whole.choices[0].finish_reason
    assert content == ""
    assert calls == calls_of(whole.choices[0].message)


async def test_auto_answers_text_or_calls_and_a_tool_turn_is_answered(model_daemon) -> None:
    client = client_for(model_daemon)
    model = (await trio.to_thread.run_sync(client.models.list)).data[0].id
    conversation = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]

    def run():
        autos = [client.chat.completions.create(model=model, messages=ASK, tools=TOOLS,
                                                max_tokens=24, temperature=1.0, seed=seed)
                 for seed in range(3)]
        auto_stream = list(client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=24,
            temperature=1.0, seed=0, stream=True))
        after_tool = client.chat.completions.create(model=model, messages=conversation,
                                                    tools=TOOLS, max_tokens=12,
                                                    temperature=0)
        no_tools = client.chat.completions.create(model=model, messages=conversation,
                                                  tools=TOOLS, tool_choice="none",
                                                  max_tokens=12, temperature=0)
        return autos, auto_stream, after_tool, no_tools

    with trio.fail_after(240):
        autos, auto_stream, after_tool, no_tools = await trio.to_thread.run_sync(run)
    for answer in autos:
        choice = answer.choices[0]
        calls = calls_of(choice.message)
        if calls:
            assert choice.finish_reason == "tool_calls"
        else:
            assert choice.finish_reason in ("stop", "length") and choice.message.content
    content, calls, reason = streamed(auto_stream)
    first = autos[0].choices[0]
    assert (content.strip(), calls, reason) == (
        (first.message.content or "").strip(), calls_of(first.message), first.finish_reason)
    for answer in (after_tool, no_tools):
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert answer.usage.prompt_tokens > 0 and answer.usage.completion_tokens > 0
    assert no_tools.choices[0].message.tool_calls is None


async def test_bad_tools_are_refused_by_name(model_daemon) -> None:
    client = client_for(model_daemon)
    model = (await trio.to_thread.run_sync(client.models.list)).data[0].id
    limit = Limits().max_grammar_bytes
    huge = [{"type": "function", "function": {"name": "f", "description": "x" * limit}}]
    cases = [
        ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
         "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
         "tools[0].function.parameters"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": huge}, "limits.max_grammar_bytes"),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {
                "a": {"type": "string", "pattern": "(unclosed"}}}}}],
          "tool_choice": "required"}, "tools"),
    ]

    def run():
        errors = []
        for extra, _ in cases:
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model=model, messages=ASK, max_tokens=4,
                                               extra_body=extra)
            errors.append(refused.value)
        with pytest.raises(openai.BadRequestError) as bad_message:
            client.chat.completions.create(model=model, max_tokens=4, messages=[
                *ASK, {"role": "tool", "content": "21"}])
        errors.append(bad_message.value)
        return errors

    with trio.fail_after(120):
        errors = await trio.to_thread.run_sync(run)
    for error, (_, named) in zip(errors, cases + [(None, "messages[1].tool_call_id")]):
        assert error.status_code == 400
        assert named in error.message, (named, error.message)


def test_tool_call_blocks_split_alike_however_the_text_arrives() -> None:
    from sluice.actors.executor import grammar
    from sluice.actors.http import openai_api as api

    text = ('Let me see. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}'
            '</tool_call>\n<tool_call>not JSON</tool_call><tool_call>{"name": "get_weather", '
            '"arguments": {"city": "Oslo", "unit": "celsius"}}</tool_call> <tool_ca')

    def split(pieces, one=False):
        parser = api.ToolCalls(one)
        parts = [part for piece in pieces for part in parser.feed(piece)] + parser.end()
        content = "".join(part for kind, part in parts if kind == "content")
        return content, [(p["function"]["name"], json.loads(p["function"]["arguments"]))
                         for kind, p in parts if kind == "call"]

    whole = split([text])
    assert whole == split(list(text)) == split([text[:20], text[20:61], text[61:]])
    assert whole == ("Let me see. \n<tool_call>not JSON</tool_call> <tool_ca",
                     [("get_time", {"zone": "UTC"}),
                      ("get_weather", {"city": "Oslo", "unit": "celsius"})])
    content, calls = split([text], one=True)  # parallel_tool_calls: false
    assert [name for name, _ in calls] == ["get_time"] and "get_weather" in content
    # a function's `$defs` still resolve once its schema is nested in the call's grammar
    referring = {"type": "object", "$defs": {"zone": {"type": "string"}},
                 "properties": {"zone": {"$ref": "#/$defs/zone"}}}
    grammar.check("lark", api.tool_grammar(
        [{"type": "function", "function": {"name": "f", "parameters": referring}}], None))


def test_the_template_gets_the_tools_or_a_preamble_of_them() -> None:
    from sluice.actors.executor.model_files import resolve_model_path
    from sluice.actors.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(None))
    messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    # the embedded template reads neither `tools` nor `tool_calls`: Hermes-style text
    text = tokenizer.apply_chat_template(messages, tools=TOOLS)
    assert text.count('"name": "get_weather"') == 2 and "<tools>" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>21 degrees</tool_response>" in text
    # a template that reads them gets them as transformers passes them
    tokenizer.chat_template = (
        "{% for tool in tools %}[{{ tool.function.name }}]{% endfor %}{% for message in "
        "messages %}{{ message.role }}:{{ message.content }}{% for call in message.tool_calls "
        "or [] %}({{ call.function.arguments }}){% endfor %};{% endfor %}")
    tokenizer._template = None
    assert tokenizer.apply_chat_template(messages, tools=TOOLS) == (
        '[get_weather][get_time]user:What is the weather in Paris?;assistant:'
        '({"city": "Paris"});tool:21 degrees;')
