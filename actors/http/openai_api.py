"""The OpenAI HTTP API in sluice's terms: request bodies to `Generate`, outcomes to responses.

A request body becomes the same typed `m.Generate` the ZeroMQ front decodes, so its values
are judged once, by the same code (`SamplingParams`, `intake`, the Tokenizer and the
scheduler core); what is checked here is only what OpenAI's shape adds: types of the JSON
values, the parameters we do not support (refused by name, never ignored) and the mapping of
OpenAI's names to ours. An outcome (`Rejected`, `Error`, `Finished`) becomes an HTTP status
and OpenAI's error body `{"error": {"message", "type", "param", "code"}}`, and the chunks
become completion objects or server-sent events.

Pure functions and values: no trio, no sockets, no actor. The HTTP actor (`actors.http.front`)
does the I/O.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import sys
import time
import dataclasses
from dataclasses import dataclass
from typing import Any

from sluice.actors.front.limits import Limits
from sluice.ipc import messages as m
from sluice.ipc.vocabulary import (
    INT64_MAX, FinishReason, InvalidParams, RejectCode, SamplingParams, choice_seed, shown,
)

# refused by name: a client that relies on one of them must not get a silent wrong answer
UNSUPPORTED = ("functions", "function_call",
               "echo", "best_of", "suffix", "audio", "modalities", "prediction")
# accepted and without effect on the output
IGNORED = ("user", "store", "metadata", "service_tier")
# ours: extensions both endpoints take, as vLLM spells them
EXTENSIONS = ("top_k", "min_p", "ignore_eos", "priority", "repetition_penalty", "timeout",
              "guided_json", "guided_regex", "guided_choice", "structured_outputs")
_COMMON = ("model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed",
           "stop", "n", "presence_penalty", "frequency_penalty", "logit_bias",
           "response_format", *EXTENSIONS, *IGNORED)
CHAT_PARAMETERS = frozenset((*_COMMON, "messages", "max_completion_tokens", "logprobs",
                             "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"))
COMPLETION_PARAMETERS = frozenset((*_COMMON, "prompt", "logprobs"))
MAX_LOGPROBS = 20  # alternatives per token, as `SamplingParams` allows
# the spellings of a grammar a request may use, one at a time: (where, kind) as parsed
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice"}
STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}
JSON_OBJECT = '{"type": "object"}'  # response_format json_object: any JSON object
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a function's name, as OpenAI takes it
TOOL_CHOICES = ("none", "auto", "required")
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"  # the Hermes/Qwen format of a call


DEFAULT_LIMITS = Limits()


class ApiError(Exception):
    """An outcome that is an HTTP error: status and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after  # seconds, sent as `Retry-After`

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(param: str | None, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}" if param else message, param=param)


@dataclass(frozen=True)
class ApiRequest:
    """A parsed request body: what to generate, and how to answer."""

    generate: m.Generate
    chat: bool
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last event with the usage
    model: str
    n: int = 1  # choices: each its own request, with its own seed stream
    tool_calls: bool = False  # the output's `<tool_call>` blocks are answered as tool calls
    one_call: bool = False  # parallel_tool_calls: false, only the first block is a call

    @property
    def logprobs(self) -> bool:
        """The answer carries logprobs (the request asked for them)."""
        return self.generate.sampling.logprobs is not None


# -- request bodies -------------------------------------------------------------------------


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body, or a 400 saying what is wrong with it: JSON as
    RFC 8259 has it (no NaN or Infinity), numbers Python can read (at most 4300 digits),
    nesting the parser can follow, and strings that are text (no lone UTF-16 surrogate)."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(None, f"the body is not JSON: {exc}") from None
    except RecursionError:
        raise invalid(None, "the body is not JSON we take: it is nested too deeply") from None
    except ValueError:  # an integer past Python's digit limit for reading one
        raise invalid(None, "the body is not JSON we take: it holds an integer of more than "
                      f"{sys.get_int_max_str_digits()} digits") from None
    if not isinstance(body, dict):
        raise invalid(None, "the body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):  # `\ud800`: perhaps half of a pair, perhaps alone
        _refuse_lone_surrogates(body)
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abAB]")


def _refuse_constant(name: str) -> None:
    raise invalid(None, f"the body is not JSON: {name} is not a JSON number")


def _refuse_lone_surrogates(body: dict[str, Any]) -> None:
    """A string with an unpaired surrogate escape is not text: no tokenizer can take it."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError as exc:
                raise invalid(path or None, f"holds a lone UTF-16 surrogate at character "
                              f"{exc.start}: not text") from None
        elif isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else key
                stack += [(where, key), (where, item)]
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def chat_request(body: dict[str, Any], *, request_id: str, tenant: str, credits: int,
                 max_model_len: int, limits: Limits = DEFAULT_LIMITS) -> ApiRequest:
    _refuse_unknown(body, CHAT_PARAMETERS)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise invalid("messages", "must be a list of messages")
    chat = tuple(_chat_message(i, message) for i, message in enumerate(messages))
    tools, choice = _tools(body, limits)
    request = _request(body, request_id, tenant, credits, max_model_len, limits, chat=True,
                       messages=chat, tools=None if choice == "none" else _json_text(tools),
                       forced=None if choice in ("none", "auto") else tool_grammar(
                           tools, None if choice == "required" else choice))
    if choice == "none":
        return request
    if request.stream and request.logprobs:
        raise invalid("logprobs", "is not answered with tools in a stream")
    parallel = _typed(body, "parallel_tool_calls", bool, True)
    return dataclasses.replace(request, tool_calls=True, one_call=not parallel)


def completion_request(body: dict[str, Any], *, request_id: str, tenant: str, credits: int,
                       max_model_len: int, limits: Limits = DEFAULT_LIMITS) -> ApiRequest:
    _refuse_unknown(body, COMPLETION_PARAMETERS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return _request(body, request_id, tenant, credits, max_model_len, limits, chat=False,
                        prompt=prompt)
    if isinstance(prompt, list) and len(prompt) + 1 > max_model_len:
        # by its length alone: a body may carry millions of ids, none worth looking at
        raise ApiError(400, f"prompt: {len(prompt)} tokens leave no room to generate within "
                       f"max_model_len {max_model_len}", param="prompt",
                       code="context_length_exceeded")
    if isinstance(prompt, list) and all(_is_int(token) for token in prompt):
        if prompt and not (-INT64_MAX - 1 <= min(prompt) and max(prompt) <= INT64_MAX):
            raise invalid("prompt", "a token id does not fit in 64 bits")
        return _request(body, request_id, tenant, credits, max_model_len, limits, chat=False,
                        prompt_ids=tuple(prompt))
    raise invalid("prompt", "must be a string or a list of token ids (one prompt per request)")


def _refuse_unknown(body: dict[str, Any], known: frozenset[str]) -> None:
    for name in UNSUPPORTED:
        if name in body and body[name] not in (None, False):
            raise invalid(name, "is not supported by this server")
    for name in body:
        if name not in known and name not in UNSUPPORTED:
            raise invalid(name, "unknown parameter")


def _chat_message(index: int, message: Any) -> m.ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(where, "must be an object with role and content")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise invalid(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}")
    known = ("role", "content", "name", *{"assistant": ("tool_calls", "refusal"),
                                          "tool": ("tool_call_id",)}.get(role, ()))
    for name in message:
        if name not in known:
            raise invalid(f"{where}.{name}", "is not supported by this server"
                          if name not in ("tool_calls", "tool_call_id")
                          else f"is not taken in a {role} message")
    calls = "" if message.get("tool_calls") is None else _message_calls(
        f"{where}.tool_calls", message["tool_calls"])
    call_id = ""
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"{where}.tool_call_id", "must name the call this message answers")
    content = message.get("content")
    if content is None and calls:
        content = ""  # an assistant turn of calls alone
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise invalid(f"{where}.content[{i}]", "only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise invalid(f"{where}.content[{i}].text", "must be a string")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise invalid(f"{where}.content", "must be a string or a list of text parts")
    return m.ChatMessage("system" if role == "developer" else role, content, calls, call_id)


def _message_calls(where: str, calls: Any) -> str:
    """An assistant message's `tool_calls`, checked, as compact JSON text."""
    if not isinstance(calls, list):
        raise invalid(where, "must be a list of tool calls")
    for i, call in enumerate(calls):
        at = f"{where}[{i}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise invalid(at, 'must be an object of type "function"')
        function = call.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{at}.function", "must be an object with name and arguments")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise invalid(f"{at}.function.name", "must be a non-empty string")
        if not isinstance(function.get("arguments"), str):
            raise invalid(f"{at}.function.arguments", "must be a string (the arguments' JSON)")
        if not isinstance(call.get("id", ""), str):
            raise invalid(f"{at}.id", "must be a string")
    return _json_text(calls)


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _tools(body: dict[str, Any], limits: Limits) -> tuple[list[dict], str]:
    """The functions of `tools`, each checked, and what `tool_choice` asks: "none", "auto",
    "required" or the name of the one function the answer must call."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise invalid("tool_choice", "needs tools")
        return [], "none"
    if not isinstance(tools, list) or not tools:
        raise invalid("tools", "must be a non-empty list of functions")
    size = len(_json_text(tools).encode())
    if size > limits.max_grammar_bytes:
        raise invalid("tools", f"{size} bytes exceed limits.max_grammar_bytes = "
                      f"{limits.max_grammar_bytes}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(f"{where}.type", 'must be "function"')
        if set(tool) - {"type", "function"}:
            raise invalid(f"{where}.{sorted(set(tool) - {'type', 'function'})[0]}",
                          "unknown field")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{where}.function", "must be an object with name and parameters")
        unknown = set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise invalid(f"{where}.function.{sorted(unknown)[0]}", "unknown field")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise invalid(f"{where}.function.name", "must be 1 to 64 letters, digits, _ or -, "
                          f"got {shown(name)}")
        if name in names:
            raise invalid(f"{where}.function.name", f"{name!r} is named twice")
        names.add(name)
        if not isinstance(function.get("description", ""), str):
            raise invalid(f"{where}.function.description", "must be a string")
        if not isinstance(function.get("parameters", {}), dict):
            raise invalid(f"{where}.function.parameters", "must be a JSON schema (an object)")
        if not isinstance(function.get("strict", False), (bool, type(None))):
            raise invalid(f"{where}.function.strict", "must be a boolean")
    if choice is None or choice in TOOL_CHOICES:
        return tools, choice or "auto"
    if (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        if choice["function"]["name"] not in names:
            raise invalid("tool_choice.function.name", f"{shown(choice['function']['name'])} "
                          "is none of the tools")
        return tools, choice["function"]["name"]
    raise invalid("tool_choice", 'must be "none", "auto", "required" or {"type": "function", '
                  '"function": {"name": ...}}')


def tool_grammar(tools: list[dict], name: str | None) -> str:
    """A Lark grammar (llguidance's, with its `%json`) for exactly one `<tool_call>` block
    whose JSON is {"name", "arguments"}: `name` one of the tools (or the `name` given) and
    `arguments` valid for that function's parameters."""
    alternatives = []
    # each function's `$defs` (and `definitions`) lifted to the root, where its `#/$defs/..`
    # references point once its schema is nested in the call's
    lifted: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        parameters = function.get("parameters") or {"type": "object"}
        for key, defs in lifted.items():
            found = parameters.get(key)
            for def_name, schema in (found if isinstance(found, dict) else {}).items():
                if defs.setdefault(def_name, schema) != schema:
                    raise invalid("tools", f"two functions define {key}.{def_name} "
                                  "differently: a forced call needs them alike")
        alternatives.append({"type": "object", "properties": {
            "name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False})
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    schema = {**schema, **{key: defs for key, defs in lifted.items() if defs},
              "x-guidance": {"whitespace_flexible": False}}
    return (f"start: {json.dumps(TOOL_OPEN)} call {json.dumps(TOOL_CLOSE)}\n"
            f"call: %json {_json_text(schema)}\n")


def _request(body: dict[str, Any], request_id: str, tenant: str, credits: int,
             max_model_len: int, limits: Limits, *, chat: bool, forced: str | None = None,
             **prompt: Any) -> ApiRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "must name the model (see GET /v1/models)")
    stream = _typed(body, "stream", bool, False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("stream_options", "is only allowed with stream: true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise invalid("stream_options", "only include_usage is supported")
        include_usage = _typed(options, "include_usage", bool, False, "stream_options.")
    n = 1 if body.get("n") is None else body["n"]
    if not _is_int(n) or not 1 <= n <= limits.max_n:
        raise invalid("n", f"must be an integer in [1, limits.max_n = {limits.max_n}], "
                      f"got {shown(n)}")
    if n > 1 and stream:
        raise invalid("n", "more than one choice is answered without stream only")
    timeout = None if body.get("timeout") is None else _number(body, "timeout")
    generate = m.Generate(request_id, sampling=_sampling(body, chat, max_model_len, limits,
                                                         forced),
                          priority=_typed(body, "priority", int, 0), tenant=tenant,
                          credits=credits, timeout=timeout, **prompt)
    return ApiRequest(generate, chat, stream, include_usage, model, n)


def _sampling(body: dict[str, Any], chat: bool, max_model_len: int,
              limits: Limits, forced: str | None = None) -> SamplingParams:
    max_tokens = body.get("max_tokens")
    name = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens, name = body["max_completion_tokens"], "max_completion_tokens"
    if max_tokens is None:
        max_tokens = max_model_len  # up to the context, what the scheduler clamps it to
    elif not _is_int(max_tokens):
        raise invalid(name, "must be an integer")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise invalid("stop", "must be a string or a list of strings")
    values = {"max_tokens": max_tokens, "stop": stop}
    for key in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty"):
        if body.get(key) is not None:
            values[key] = _number(body, key)
    for key in ("top_k", "seed"):
        if body.get(key) is not None:
            values[key] = _typed(body, key, int, None)
    if body.get("top_k") == -1:
        values["top_k"] = 0  # vLLM's spelling of "no top-k cut"
    if body.get("ignore_eos") is not None:
        values["ignore_eos"] = _typed(body, "ignore_eos", bool, False)
    values["logprobs"] = _logprobs(body, chat)
    bias = _logit_bias(body, limits)
    if bias:
        values["logit_bias_ids"], values["logit_bias_values"] = zip(*bias)
    grammar = _grammar(body, limits)
    if forced is not None:  # a tool call the answer must make: the grammar of its block
        if grammar is not None:
            raise invalid("tool_choice", f"a forced tool call is a constraint of its own: "
                          f"{grammar_param(body)} is given too")
        if len(forced.encode()) > limits.max_grammar_bytes:
            raise invalid("tools", f"the grammar of the forced call exceeds "
                          f"limits.max_grammar_bytes = {limits.max_grammar_bytes}")
        grammar = ("lark", forced)
    if grammar is not None:
        values["grammar_kind"], values["grammar"] = grammar
    try:
        return SamplingParams(**values)
    except InvalidParams as exc:
        param = name if exc.field == "max_tokens" else exc.field
        raise invalid(param, exc.message) from None


def _logit_bias(body: dict[str, Any], limits: Limits) -> list[tuple[int, float]]:
    """OpenAI's `logit_bias`: {"token id": bias in [-100, 100]}, at most
    `limits.max_logit_bias` entries (ids inside the vocabulary are checked with the prompt)."""
    bias = body.get("logit_bias")
    if bias is None:
        return []
    if not isinstance(bias, dict):
        raise invalid("logit_bias", "must be an object of token id (a string) -> bias")
    if len(bias) > limits.max_logit_bias:
        raise invalid("logit_bias", f"{len(bias)} entries exceed limits.max_logit_bias = "
                      f"{limits.max_logit_bias}")
    pairs = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 19):
            raise invalid("logit_bias", f"key {shown(key)} is not a token id")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid("logit_bias", f"the bias of token {key} must be a number")
        if not -100 <= value <= 100:
            raise invalid("logit_bias", f"the bias of token {key} must be in [-100, 100], "
                          f"got {shown(value)}")
        pairs.append((int(key), float(value)))
    return sorted(pairs)


def _grammar(body: dict[str, Any], limits: Limits) -> tuple[str, str] | None:
    """The constraint a request puts on its output as (`grammar_kind`, `grammar`), from
    `response_format` or vLLM's extensions, or None. At most one of them, and its text
    within `limits.max_grammar_bytes`; whether it is a grammar is checked by the front."""
    found: list[tuple[str, str, Any]] = []  # (param, kind, value)
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or not isinstance(
                response_format.get("type"), str):
            raise invalid("response_format", "must be an object with a type")
        kind = response_format["type"]
        if kind == "json_object":
            found.append(("response_format", "json_schema", JSON_OBJECT))
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            where = "response_format.json_schema"
            if not isinstance(spec, dict):
                raise invalid(where, "must be an object with name and schema")
            if set(spec) - {"name", "schema", "strict", "description"}:
                unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})[0]
                raise invalid(f"{where}.{unknown}", "unknown field")
            if not isinstance(spec.get("name", ""), str):
                raise invalid(f"{where}.name", "must be a string")
            if not isinstance(spec.get("strict", False), (bool, type(None))):
                raise invalid(f"{where}.strict", "must be a boolean")
            schema = spec.get("schema", {})  # OpenAI: no schema is any JSON object
            if not isinstance(schema, dict):
                raise invalid(f"{where}.schema", "must be a JSON schema (an object)")
            found.append((f"{where}.schema", "json_schema", schema or json.loads(JSON_OBJECT)))
        elif kind != "text":
            raise invalid("response_format.type", "must be text, json_object or json_schema, "
                          f"got {shown(kind)}")
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, kind, body[name]))
    structured = body.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise invalid("structured_outputs", "must be an object")
        for name, value in structured.items():
            if name not in STRUCTURED:
                raise invalid(f"structured_outputs.{name}", "is not supported by this server")
            if value is not None:
                found.append((f"structured_outputs.{name}", STRUCTURED[name], value))
    if not found:
        return None
    if len(found) > 1:
        raise invalid(found[1][0], f"only one constraint per request: {found[0][0]} is given")
    param, kind, value = found[0]
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise invalid(param, "is not JSON") from None
        if not isinstance(value, (dict, bool)):
            raise invalid(param, "must be a JSON schema (an object)")
        text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    elif kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise invalid(param, "must be a non-empty list of non-empty strings")
        text = json.dumps(value, separators=(",", ":"))
    else:
        if not isinstance(value, str) or not value:
            raise invalid(param, "must be a non-empty string")
        text = value
    size = len(text.encode())
    if size > limits.max_grammar_bytes:
        raise invalid(param, f"{size} bytes exceed limits.max_grammar_bytes = "
                      f"{limits.max_grammar_bytes}")
    return kind, text


def grammar_param(body: dict[str, Any]) -> str:
    """Which parameter of a body carried its grammar (what an error about it names)."""
    if body.get("tool_choice") not in (None, "none", "auto"):
        return "tools"
    if isinstance(body.get("response_format"), dict):
        return ("response_format.json_schema.schema"
                if body["response_format"].get("type") == "json_schema" else "response_format")
    for name in GUIDED:
        if body.get(name) is not None:
            return name
    return "structured_outputs"


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives per token the answer lists, None for no logprobs at all. Chat
    asks with `logprobs: true` and `top_logprobs: N`; completions with `logprobs: N`."""
    if not chat:
        top = _typed(body, "logprobs", int, None)
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise invalid("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {shown(top)}")
        return top
    wanted = _typed(body, "logprobs", bool, False)
    top = _typed(body, "top_logprobs", int, None)
    if top is not None and not wanted:
        raise invalid("top_logprobs", "needs logprobs: true")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise invalid("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {shown(top)}")
    return (top or 0) if wanted else None


def _typed(body: dict[str, Any], key: str, kind: type, default: Any, prefix: str = "") -> Any:
    value = body.get(key)
    if value is None:
        return default
    if kind is int and _is_int(value):
        return value
    if kind is bool and isinstance(value, bool):
        return value
    raise invalid(prefix + key, f"must be {'an integer' if kind is int else 'a boolean'}")


def _number(body: dict[str, Any], key: str) -> float:
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(key, "must be a number")
    try:
        number = float(value)
    except OverflowError:  # an integer past any float
        number = math.inf
    if not math.isfinite(number):  # 1e999 reads as infinity
        raise invalid(key, f"must be a finite number, got {shown(value)}")
    return number


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- outcomes -------------------------------------------------------------------------------


def param_name(field: str) -> str | None:
    """The OpenAI parameter a sluice field (`Rejected.field`) is about, None for none."""
    if not field:
        return None
    name = field.removeprefix("sampling.").split("[", 1)[0]
    if name in ("prompt_ids", "prompt_token_ids"):
        return "prompt"
    if name in ("request_id", "connection", "connections", "max_requests_per_connection",
                "frame", "credits", "worker"):
        return None
    return name


def rejected_error(rejected: m.Rejected, retry_after: int) -> ApiError:
    """The HTTP error a `Rejected` is (the README's table). `retry_after` is the front's
    default, used when the daemon has no estimate of its own."""
    code, param = rejected.code, param_name(rejected.field)
    if rejected.retry_after > 0:
        retry_after = math.ceil(rejected.retry_after)
    if code is RejectCode.TOO_LONG:
        return ApiError(400, rejected.message, param=param, code="context_length_exceeded")
    if code is RejectCode.UNAUTHORIZED:
        return ApiError(401, rejected.message, type="authentication_error",
                        code="invalid_api_key")
    if code is RejectCode.DRAINING:
        return ApiError(503, rejected.message, type="server_error", code="draining",
                        retry_after=retry_after)
    if code is RejectCode.OVERLOADED and rejected.field == "worker":
        return ApiError(503, rejected.message, type="server_error", code="worker_failed",
                        retry_after=retry_after)
    if code is RejectCode.OVERLOADED:
        return ApiError(429, rejected.message, type="rate_limit_error", code="overloaded",
                        param=param, retry_after=retry_after)
    if code is RejectCode.QUOTA:
        return ApiError(429, rejected.message, type="rate_limit_error", code="quota_exceeded",
                        retry_after=retry_after)
    return ApiError(400, rejected.message, param=param)


def ended_error(reason: FinishReason, message: str) -> ApiError:
    """The error of a request that ended without a `stop` or `length`."""
    if reason is FinishReason.TIMEOUT:
        return ApiError(408, message or "the client did not read the response in time: "
                        "the request timed out", type="timeout_error", code="timeout")
    if reason is FinishReason.CANCELLED:
        return ApiError(503, message or "the request was cancelled in the daemon",
                        type="server_error", code="cancelled")
    return ApiError(500, message or "the request failed in the daemon", type="server_error",
                    code=reason.name.lower())


def finish_reason(reason: FinishReason) -> str:
    return "length" if reason is FinishReason.LENGTH else "stop"


def usage(accepted_prompt: int, finished: m.Finished | None) -> dict[str, Any]:
    used = finished.usage if finished is not None else m.Usage()
    prompt = used.prompt_tokens or accepted_prompt
    return {"prompt_tokens": prompt, "completion_tokens": used.completion_tokens,
            "total_tokens": prompt + used.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": used.cached_tokens}}


# -- response bodies ------------------------------------------------------------------------


def merge_choices(bodies: list[dict[str, Any]], request_id: str) -> dict[str, Any]:
    """One completion object of n choices from the n single-choice ones; the prompt counted
    once, the choices' cached prompt tokens (prefix-cache hits) summed."""
    merged = dict(bodies[0])
    merged["id"] = response_id(merged["object"] == "chat.completion", request_id)
    merged["choices"] = [dict(body["choices"][0], index=i) for i, body in enumerate(bodies)]
    prompt = bodies[0]["usage"]["prompt_tokens"]
    completion = sum(body["usage"]["completion_tokens"] for body in bodies)
    cached = sum(body["usage"]["prompt_tokens_details"]["cached_tokens"] for body in bodies)
    merged["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                       "total_tokens": prompt + completion,
                       "prompt_tokens_details": {"cached_tokens": cached}}
    return merged


def response_id(chat: bool, request_id: str) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"


def logprobs_body(request: ApiRequest, tokens: list[m.TokenLogprobs],
                  text_offset: int = 0) -> dict[str, Any] | None:
    """OpenAI's `logprobs` of a choice for these tokens (None when none were asked for).

    Chat: `{"content": [{token, logprob, bytes, top_logprobs}], "refusal"}`. Completions:
    the legacy columns, where each `top_logprobs` map also holds the sampled token (as vLLM
    does) and `text_offset` counts characters of the token texts from `text_offset`."""
    if not request.logprobs:
        return None
    if request.chat:
        return {"content": [_chat_logprob(t) for t in tokens], "refusal": None}
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token.token)
    return {"tokens": [t.token for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [_top_map(t) for t in tokens],
            "text_offset": offsets}


def _top_map(token: m.TokenLogprobs) -> dict[str, float]:
    """Text -> logprob, most likely first; two tokens of one text keep the likelier."""
    top: dict[str, float] = {}
    for alternative in token.top:
        top.setdefault(alternative.token, alternative.logprob)
    top.setdefault(token.token, token.logprob)
    return top


def _chat_logprob(token: m.TokenLogprobs) -> dict[str, Any]:
    return {"token": token.token, "logprob": token.logprob, "bytes": list(token.token.encode()),
            "top_logprobs": [{"token": a.token, "logprob": a.logprob,
                              "bytes": list(a.token.encode())} for a in token.top]}


def completion_body(request: ApiRequest, request_id: str, created: int, text: str,
                    reason: str, used: dict[str, Any],
                    logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    if request.chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if request.tool_calls:
            parser = ToolCalls(request.one_call)
            parts = parser.feed(text) + parser.end()
            content = "".join(part for kind, part in parts if kind == "content")
            calls = [part for kind, part in parts if kind == "call"]
            message["content"] = content if content.strip() else None
            if calls:
                message["tool_calls"] = calls
                reason = "tool_calls" if reason == "stop" else reason
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
    return {"id": response_id(request.chat, request_id),
            "object": "chat.completion" if request.chat else "text_completion",
            "created": created, "model": request.model, "choices": [choice], "usage": used}


def stream_event(request: ApiRequest, request_id: str, created: int, text: str | None,
                 reason: str | None, *, first: bool = False,
                 used: dict[str, Any] | None = None,
                 logprobs: dict[str, Any] | None = None) -> bytes:
    """One server-sent event: a text delta (with its tokens' logprobs), the finish reason, or
    (no choice) the usage."""
    choices: list[dict[str, Any]] = []
    if used is None:
        if request.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choices = [{"index": 0, "delta": delta, "logprobs": logprobs,
                        "finish_reason": reason}]
        else:
            choices = [{"index": 0, "text": text or "", "logprobs": logprobs,
                        "finish_reason": reason}]
    event: dict[str, Any] = {
        "id": response_id(request.chat, request_id),
        "object": "chat.completion.chunk" if request.chat else "text_completion",
        "created": created, "model": request.model, "choices": choices}
    if request.include_usage:
        event["usage"] = used
    return sse(event)


def tool_call_event(request: ApiRequest, request_id: str, created: int, index: int,
                    call: dict[str, Any]) -> bytes:
    """A streamed tool call, whole: one `delta.tool_calls` entry, as OpenAI streams them."""
    delta = {"tool_calls": [{"index": index, **call}]}
    return sse({"id": response_id(True, request_id), "object": "chat.completion.chunk",
                "created": created, "model": request.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": None}],
                **({"usage": None} if request.include_usage else {})})


class ToolCalls:
    """The model's text split into content and tool calls as it comes: each `<tool_call>`
    block whose JSON is {"name": str, "arguments": object} is a call (OpenAI's shape, its
    arguments a JSON string and its id new), any other text is content (with `one`, every
    block after the first call too). Text that may be the start of a block is held until it
    is known, so streamed and whole answers agree.

    Each delta is looked at once: an open block is kept as its pieces, and only the delta
    (with the few characters before it that could begin `</tool_call>`) is searched for
    its end, so a block streamed a token at a time costs its length, not its length squared.
    """

    def __init__(self, one: bool = False) -> None:
        self.held = ""  # outside a block: the end of the text that could begin one
        self.inside = False
        self.block: list[str] = []  # inside a block: its text so far, from `<tool_call>`
        self.tail = ""  # ... and its last characters, which could begin `</tool_call>`
        self.calls_left = 1 if one else -1  # -1: no limit

    def feed(self, text: str) -> list[tuple[str, Any]]:
        """("content", str) and ("call", dict) parts, in order, that `text` completes."""
        parts: list[tuple[str, Any]] = []
        while True:
            if not self.inside:
                text, self.held = self.held + text, ""
                at = text.find(TOOL_OPEN)
                if at < 0:
                    ready = len(text) - _open_prefix(text)
                    if ready:
                        parts.append(("content", text[:ready]))
                    self.held = text[ready:]
                    return parts
                if at:
                    parts.append(("content", text[:at]))
                self.inside, self.block, self.tail = True, [TOOL_OPEN], ""
                text = text[at + len(TOOL_OPEN):]
            seen = self.tail + text
            end = seen.find(TOOL_CLOSE)
            if end < 0:
                self.block.append(text)
                self.tail = seen[max(0, len(seen) - len(TOOL_CLOSE) + 1):]
                return parts
            cut = end + len(TOOL_CLOSE) - len(self.tail)  # where the block ends in `text`
            self.block.append(text[:cut])
            block, text = "".join(self.block), text[cut:]
            self.inside, self.block, self.tail = False, [], ""
            call = None if self.calls_left == 0 else parse_tool_call(
                block[len(TOOL_OPEN):-len(TOOL_CLOSE)])
            parts.append(("content", block) if call is None else ("call", call))
            if call is not None and self.calls_left > 0:
                self.calls_left -= 1

    def end(self) -> list[tuple[str, Any]]:
        """What is left once the text ended: content (an unclosed block is text)."""
        held = "".join(self.block) if self.inside else self.held
        self.held, self.inside, self.block, self.tail = "", False, [], ""
        return [("content", held)] if held else []


def _open_prefix(text: str) -> int:
    """How many characters at the end of `text` could begin `<tool_call>`."""
    for size in range(min(len(text), len(TOOL_OPEN) - 1), 0, -1):
        if TOOL_OPEN.startswith(text[-size:]):
            return size
    return 0


def parse_tool_call(text: str) -> dict[str, Any] | None:
    """OpenAI's tool call for a block's JSON, None when it is not a call."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if (not isinstance(value, dict) or not isinstance(value.get("name"), str)
            or not value["name"] or not isinstance(value.get("arguments", {}), (dict, str))):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": value["name"], "arguments": arguments}}


class DeltaEvents:
    """`stream_event` of a text delta without logprobs, for one response, made by pasting
    the text's JSON between bytes built once: the one event sent per token."""

    _MARK = "\x00sluice-delta\x00"

    def __init__(self, request: ApiRequest, request_id: str, created: int):
        event = stream_event(request, request_id, created, self._MARK, None)
        self.head, mark, self.tail = event.partition(json.dumps(self._MARK).encode())
        assert mark, "the event's text went missing from its template"

    def __call__(self, text: str) -> bytes:
        return self.head + json.dumps(text).encode() + self.tail


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def now() -> int:
    return int(time.time())
