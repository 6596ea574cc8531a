"""The OpenAI request and outcome mapping without a daemon: bodies to `Generate`, refusals
to statuses, API keys to tenants, and the `[http]` table of the config."""

from __future__ import annotations

import os

import pytest

from sluice.actors.http import openai_api as api
from sluice.actors.http.front import HttpSettings, KeyRing
from sluice.daemon.config import ConfigFileError, load_config
from sluice.ipc import messages as m
from sluice.ipc.vocabulary import RejectCode

ARGS = dict(request_id="7", tenant="default", credits=4, max_model_len=2048)


def test_a_chat_body_is_the_generate_the_zeromq_front_would_send() -> None:
    request = api.chat_request({
        "model": "m", "stream": True, "stream_options": {"include_usage": True},
        "max_completion_tokens": 9, "temperature": 0, "top_p": 0.5, "seed": 3,
        "stop": "END", "top_k": 5, "min_p": 0.1, "ignore_eos": True, "priority": 2,
        "user": "someone", "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                         {"type": "text", "text": " you"}]}]}, **ARGS)
    generate = request.generate
    assert (request.chat, request.stream, request.include_usage) == (True, True, True)
    assert generate.messages == (m.ChatMessage("system", "Be brief."),
                                 m.ChatMessage("user", "Hi you"))
    sampling = generate.sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.seed) == (
        9, 0.0, 0.5, 3)
    assert (sampling.stop, sampling.top_k, sampling.min_p, sampling.ignore_eos) == (
        ("END",), 5, 0.1, True)
    assert (generate.priority, generate.tenant, generate.credits) == (2, "default", 4)


def test_max_tokens_omitted_runs_up_to_the_context() -> None:
    request = api.completion_request({"model": "m", "prompt": [1, 2, 3]}, **ARGS)
    assert request.generate.prompt_ids == (1, 2, 3)
    assert request.generate.sampling.max_tokens == 2048


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "top_logprobs": 2}, "top_logprobs"),  # chat's spelling only
    ({"prompt": 3}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "x", "model": 3}, "model"),
])
def test_a_bad_completion_body_names_its_parameter(body, param) -> None:
    with pytest.raises(api.ApiError) as caught:
        api.completion_request({"model": "m", **body}, **ARGS)
    assert (caught.value.status, caught.value.param) == (400, param)


@pytest.mark.parametrize("messages, param", [
    ("hi", "messages"),
    ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
    ([{"role": "user", "content": [{"type": "input_audio"}]}], "messages[0].content[0]"),
])
def test_a_bad_chat_message_is_named(messages, param) -> None:
    with pytest.raises(api.ApiError) as caught:
        api.chat_request({"model": "m", "messages": messages}, **ARGS)
    assert caught.value.param == param


@pytest.mark.parametrize("code, field, status, error_code", [
    (RejectCode.INVALID, "sampling.stop[1]", 400, None),
    (RejectCode.TOO_LONG, "prompt_ids", 400, "context_length_exceeded"),
    (RejectCode.UNAUTHORIZED, "", 401, "invalid_api_key"),
    (RejectCode.QUOTA, "tenant", 429, "quota_exceeded"),
    (RejectCode.OVERLOADED, "prompt", 429, "overloaded"),
    (RejectCode.OVERLOADED, "worker", 503, "worker_failed"),
    (RejectCode.DRAINING, "", 503, "draining"),
])
def test_each_refusal_maps_to_its_status(code, field, status, error_code) -> None:
    error = api.rejected_error(m.Rejected("1", code, "why", field), retry_after=5)
    assert (error.status, error.code) == (status, error_code)
    assert (error.retry_after is not None) == (status in (429, 503))
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}
    if code is RejectCode.INVALID:
        assert error.param == "stop"
    if code is RejectCode.TOO_LONG:
        assert error.param == "prompt"


@pytest.mark.parametrize("body, wanted", [
    ({}, None),
    ({"logprobs": False}, None),
    ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": 3}, 3),
])
def test_chat_asks_for_logprobs_as_openai_spells_it(body, wanted) -> None:
    request = api.chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                **body}, **ARGS)
    assert request.generate.sampling.logprobs == wanted
    assert request.logprobs == (wanted is not None)


@pytest.mark.parametrize("body", [
    {"top_logprobs": 2},  # without logprobs: true
    {"logprobs": True, "top_logprobs": 21},
    {"logprobs": True, "top_logprobs": -1},
    {"logprobs": 2},  # completions' spelling
])
def test_bad_chat_logprobs_are_named(body) -> None:
    with pytest.raises(api.ApiError) as caught:
        api.chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                          **body}, **ARGS)
    assert caught.value.status == 400
    assert caught.value.param == ("logprobs" if "top_logprobs" not in body else "top_logprobs")


TOKENS = [
    m.TokenLogprobs(" Paris", -0.5, (m.TopLogprob(7, " Paris", -0.5), m.TopLogprob(9, " Lyon", -1.5))),
    m.TokenLogprobs("é", -0.25, (m.TopLogprob(3, " the", -0.1), m.TopLogprob(4, "é", -0.25))),
]


def test_logprobs_take_openai_s_chat_shape() -> None:
    chat = api.chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                             "logprobs": True, "top_logprobs": 2}, **ARGS)
    body = api.logprobs_body(chat, TOKENS)
    assert body["refusal"] is None
    first, second = body["content"]
    assert (first["token"], first["logprob"], first["bytes"]) == (" Paris", -0.5, list(b" Paris"))
    assert [(a["token"], a["logprob"]) for a in first["top_logprobs"]] == [(" Paris", -0.5),
                                                                           (" Lyon", -1.5)]
    assert second["bytes"] == list("é".encode())
    plain = api.chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}]},
                             **ARGS)
    assert api.logprobs_body(plain, TOKENS) is None


def test_logprobs_take_the_legacy_completion_columns() -> None:
    request = api.completion_request({"model": "m", "prompt": "x", "logprobs": 1}, **ARGS)
    body = api.logprobs_body(request, TOKENS, text_offset=4)
    assert body["tokens"] == [" Paris", "é"]
    assert body["token_logprobs"] == [-0.5, -0.25]
    assert body["text_offset"] == [4, 10]
    # most likely first, and the sampled token is always there (as vLLM answers)
    assert list(body["top_logprobs"][0].items()) == [(" Paris", -0.5), (" Lyon", -1.5)]
    assert list(body["top_logprobs"][1].items()) == [(" the", -0.1), ("é", -0.25)]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
def test_a_delta_event_is_the_event_stream_event_builds(chat, include_usage) -> None:
    body = {"model": "m\u0000\"x", "stream": True,
            "stream_options": {"include_usage": include_usage}}
    if chat:
        request = api.chat_request({**body, "messages": [{"role": "user", "content": "x"}]},
                                   **ARGS)
    else:
        request = api.completion_request({**body, "prompt": "x"}, **ARGS)
    events = api.DeltaEvents(request, "7", 1700000000)
    for text in [" Paris", 'a "quoted"\n\\ line', "é and 😀", "\u0000"]:
        assert events(text) == api.stream_event(request, "7", 1700000000, text, None)


def test_a_key_finds_its_tenant_and_nothing_else_does() -> None:
    ring = KeyRing({"a": ["alpha", "again"], "b": ["beta"]})
    assert [ring.tenant(k) for k in (b"alpha", b"again", b"beta")] == ["a", "a", "b"]
    assert [ring.tenant(k) for k in (b"", b"alph", b"alphaa", b"BETA")] == [None] * 4
    assert not KeyRing({})


def test_http_settings_and_a_keys_file(tmp_path, monkeypatch) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# tenant key\nbatch  secret-one\n\ninteractive secret-two # a comment\n")
    os.chmod(keys, 0o600)
    config_file = tmp_path / "sluiced.toml"
    config_file.write_text('[http]\nlisten = "127.0.0.1:8000"\nmax_body_bytes = 1000\n'
                           f'tenant_keys_file = "{keys}"\n'
                           '[http.tenants]\nbatch = ["secret-zero"]\n')
    http = load_config(config_file).http
    assert (http.listen, http.max_body_bytes) == ("127.0.0.1:8000", 1000)
    assert http.tenants == {"batch": ["secret-zero", "secret-one"],
                            "interactive": ["secret-two"]}
    assert load_config(None, {"http.listen": "0.0.0.0:9000"}).http.listen == "0.0.0.0:9000"
    assert load_config(None).http.listen is None  # off unless asked

    keys.write_text("batch secret-one extra\n")
    with pytest.raises(ConfigFileError) as caught:
        load_config(config_file)
    assert "line 1" in str(caught.value) and "secret" not in str(caught.value)
    os.chmod(keys, 0o644)
    with pytest.raises(ConfigFileError, match="readable by others"):
        load_config(config_file)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    with pytest.raises(ConfigFileError, match="CREDENTIALS_DIRECTORY"):
        load_config(None, {"http.tenant_keys_file": "sluice_api_keys"})
    with pytest.raises(ValueError, match="http.max_concurrent_requests"):
        HttpSettings(max_concurrent_requests=0)
