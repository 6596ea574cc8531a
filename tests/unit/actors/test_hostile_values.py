"""Values a hostile client sends are refused where they enter, naming the field: integers a
64-bit wire cannot carry, numbers that are not finite, JSON that Python's parser reads but
the API does not take (NaN, huge integers, deep nesting, lone surrogates), and token-id
prompts longer than the context, refused by their length before any id is looked at."""

from __future__ import annotations

import json

import msgpack
import pytest

from sluice.actors.front import intake
from sluice.actors.http import openai_api as api
from sluice.actors.front.limits import Limits
from sluice.ipc import messages as m
from sluice.ipc.codec import Codec, CodecError
from sluice.ipc.vocabulary import InvalidParams, SamplingParams

ARGS = dict(request_id="7", tenant="default", credits=4, max_model_len=2048)
LARGEST = 2**63 - 1


@pytest.mark.parametrize("field, value", [
    ("max_tokens", LARGEST + 1), ("top_k", LARGEST + 1), ("seed", LARGEST + 1),
    ("seed", 2**64), ("max_tokens", 10**4000), ("temperature", float("inf")),
    ("temperature", 10**400), ("temperature", LARGEST + 1), ("top_p", float("nan")),
    ("repetition_penalty", float("inf")), ("min_p", float("nan")),
    ("presence_penalty", float("-inf")), ("logprobs", 2**64),
])
def test_sampling_refuses_what_no_wire_or_sampler_can_carry(field, value) -> None:
    with pytest.raises(InvalidParams) as refused:
        SamplingParams(**{field: value})
    assert refused.value.field == field
    assert len(refused.value.message) < 100  # a huge value is described, not printed


def test_sampling_takes_the_largest_integers_a_request_may_carry() -> None:
    params = SamplingParams(max_tokens=LARGEST, top_k=LARGEST, seed=LARGEST,
                            stop_token_ids=(LARGEST,))
    assert (params.max_tokens, params.top_k, params.seed) == (LARGEST, LARGEST, LARGEST)
    with pytest.raises(InvalidParams) as refused:
        SamplingParams(stop_token_ids=(1, LARGEST + 1))
    assert refused.value.field == "stop_token_ids[1]"


def test_a_frame_whose_sampling_is_out_of_range_names_the_field() -> None:
    frame = msgpack.packb([m.PROTOCOL_MAJOR, m.PROTOCOL_MINOR, m.Generate.TAG, {
        "request_id": "r", "prompt": "hi", "sampling": {"seed": 2**64 - 1}}])
    with pytest.raises(CodecError) as refused:
        Codec(m.CLIENT_MESSAGES).decode(frame)
    assert (refused.value.field, refused.value.request_id) == ("sampling.seed", "r")


def test_a_priority_past_64_bits_is_refused_at_intake() -> None:
    for priority in (LARGEST + 1, -LARGEST - 2):
        refused = intake.check_generate(m.Generate("r", prompt="hi", priority=priority),
                                        Limits())
        assert (refused.code, refused.field) == (m.RejectCode.INVALID, "priority")
    assert intake.check_generate(m.Generate("r", prompt="hi", priority=-LARGEST - 1),
                                 Limits()) is None


def test_a_token_id_prompt_is_refused_by_its_length_before_its_ids() -> None:
    long = m.Generate("r", prompt_ids=(1,) * 100 + (-5,))
    refused = intake.check_prompt_length(long, max_model_len=100)
    assert (refused.code, refused.field) == (m.RejectCode.TOO_LONG, "prompt_ids")
    assert "101 tokens" in refused.message and "max_model_len 100" in refused.message
    fits = m.Generate("r", prompt_ids=(1,) * 98 + (-5,))
    assert intake.check_prompt_length(fits, max_model_len=100) is None
    with pytest.raises(InvalidParams) as bad_id:
        intake.check_prompt_form(fits, vocab_size=50)
    assert bad_id.value.field == "prompt_ids[98]"


@pytest.mark.parametrize("raw, says", [
    (b'{"model": "m", "seed": ' + b"9" * 5000 + b"}", "4300 digits"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"model": "m", "temperature": NaN}', "NaN"),
    (b'{"model": "m", "temperature": Infinity}', "Infinity"),
    (b'{"model": "m", "temperature": -Infinity}', "-Infinity"),
])
def test_json_python_reads_but_the_api_does_not_take_is_a_400(raw, says) -> None:
    with pytest.raises(api.ApiError) as refused:
        api.parse_body(raw)
    assert refused.value.status == 400 and says in refused.value.message


def test_a_lone_surrogate_is_not_text() -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    with pytest.raises(api.ApiError) as refused:
        api.parse_body(raw)
    assert (refused.value.status, refused.value.param) == (400, "messages[0].content")
    paired = api.parse_body(b'{"prompt": "\\ud83d\\ude00"}')  # a pair is one character
    assert paired == {"prompt": "\U0001F600"}


@pytest.mark.parametrize("n", [True, 1.0, "1", 0, 10**6])
def test_n_must_be_an_integer_within_the_limit(n) -> None:
    with pytest.raises(api.ApiError) as refused:
        api.completion_request({"model": "m", "prompt": "hi", "n": n}, **ARGS)
    assert (refused.value.status, refused.value.param) == (400, "n")
    assert api.completion_request({"model": "m", "prompt": "hi", "n": 1}, **ARGS)


@pytest.mark.parametrize("key", ["temperature", "timeout", "top_p"])
def test_a_number_past_any_float_is_refused_by_name(key) -> None:
    for value in (10**400, json.loads("1e999")):
        with pytest.raises(api.ApiError) as refused:
            api.completion_request({"model": "m", "prompt": "hi", key: value}, **ARGS)
        assert (refused.value.status, refused.value.param) == (400, key)


def test_a_prompt_of_ids_longer_than_the_context_is_refused_before_its_ids() -> None:
    body = {"model": "m", "prompt": [1] * 2048 + ["not an id"]}
    with pytest.raises(api.ApiError) as refused:
        api.completion_request(body, **ARGS)
    assert (refused.value.param, refused.value.code) == ("prompt", "context_length_exceeded")
    assert "2049 tokens" in refused.value.message
    fits = api.completion_request({"model": "m", "prompt": [1] * 2047}, **ARGS)
    assert len(fits.generate.prompt_ids) == 2047
