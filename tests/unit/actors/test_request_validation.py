"""Everything a client can put in a Generate is either accepted or refused with the field named.

This is the daemon's validation path without sockets: the codec (which also builds the
sampling parameters, and so checks their ranges), then the intake limits the Stream checks
(small ones here, so that they are hit), then the checks the Tokenizer actor makes before
tokenizing. Hypothesis drives well over a thousand cases.
"""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.actors.front.intake import check_generate, check_prompt_form
from sluice.actors.front.limits import Limits
from sluice.ipc import messages as m
from sluice.ipc.codec import Codec, CodecError
from sluice.ipc.vocabulary import InvalidParams, SamplingParams

VOCAB = 1000
codec = Codec(m.CLIENT_MESSAGES, max_frame_bytes=4096)
LIMITS = Limits(max_request_id_chars=4, max_tenant_chars=len("default"), max_prompt_chars=15,
                max_messages=1, max_stop_strings=2, max_stop_string_chars=2)


class OverLimit(Exception):
    def __init__(self, rejected: m.Rejected):
        super().__init__(rejected.message)
        self.rejected = rejected

numbers = st.one_of(
    st.integers(-(2**63), 2**63 - 1), st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(), st.none(), st.text(max_size=4),
)
sampling_values = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": numbers, "temperature": numbers, "top_p": numbers, "top_k": numbers,
        "min_p": numbers, "seed": numbers, "ignore_eos": numbers,
        "stop": st.one_of(st.lists(st.text(max_size=3), max_size=3), numbers),
        "stop_token_ids": st.one_of(st.lists(st.integers(-5, 2 * VOCAB), max_size=3), numbers),
        "repetition_penalty": numbers, "presence_penalty": numbers,
        "frequency_penalty": numbers, "bogus": numbers,
    },
)
bodies = st.fixed_dictionaries(
    {"request_id": st.one_of(st.text(min_size=1, max_size=5), numbers)},
    optional={
        "prompt": st.one_of(st.text(max_size=20), numbers),
        "prompt_ids": st.one_of(st.lists(st.integers(-5, 2 * VOCAB), max_size=5), numbers),
        "messages": st.one_of(
            st.lists(st.fixed_dictionaries({"role": st.text(max_size=5),
                                            "content": st.one_of(st.text(max_size=5), numbers)}),
                     max_size=2),
            numbers,
        ),
        "sampling": st.one_of(sampling_values, numbers),
        "priority": numbers,
        "tenant": st.one_of(st.text(max_size=9), numbers),
        "credits": numbers,
    },
)


def validate(frame: bytes, limits: Limits = LIMITS) -> SamplingParams:
    msg = codec.decode(frame)
    refused = check_generate(msg, limits)
    if refused is not None:
        raise OverLimit(refused)
    check_prompt_form(msg, VOCAB)
    return msg.sampling


@settings(max_examples=1200, deadline=None)
@given(body=bodies, major=st.sampled_from([m.PROTOCOL_MAJOR] * 5 + [0, 9]))
def test_generate_is_accepted_or_refused_with_a_named_field(body: dict, major: int) -> None:
    frame = msgpack.packb([major, 0, m.Generate.TAG, body], use_bin_type=True)
    try:
        sampling = validate(frame)
    except CodecError as exc:
        assert exc.field and exc.message
        if major != m.PROTOCOL_MAJOR:
            assert exc.code is m.RejectCode.PROTOCOL_VERSION
        return
    except OverLimit as exc:
        assert exc.rejected.field and "limits." in exc.rejected.message
        assert exc.rejected.request_id == body["request_id"]
        return
    except InvalidParams as exc:
        assert exc.field and str(exc)
        return
    assert major == m.PROTOCOL_MAJOR
    assert len(body["request_id"]) <= LIMITS.max_request_id_chars
    assert len(body.get("tenant", "")) <= LIMITS.max_tenant_chars
    stops = body.get("sampling", {}).get("stop", [])
    assert len(stops) <= LIMITS.max_stop_strings
    assert all(len(stop) <= LIMITS.max_stop_string_chars for stop in stops)
    if body.get("prompt") is not None:
        assert len(body["prompt"]) <= LIMITS.max_prompt_chars
    if body.get("messages") is not None:
        assert len(body["messages"]) <= LIMITS.max_messages
    assert sampling.max_tokens >= 1 and 0 < sampling.top_p <= 1 and sampling.temperature >= 0
    given_forms = [k for k in ("prompt", "prompt_ids", "messages") if body.get(k) is not None]
    assert len(given_forms) == 1
    if "prompt_ids" in given_forms:
        assert all(0 <= t < VOCAB for t in body["prompt_ids"])


def test_absurd_sampling_values_name_the_parameter() -> None:
    for name, value in [("temperature", -1.0), ("top_p", 7.0), ("top_k", -3), ("min_p", 2.0),
                        ("max_tokens", 0), ("seed", -1), ("presence_penalty", 99.0)]:
        frame = codec.encode(m.Generate("r", prompt="hi"))
        raw = msgpack.unpackb(frame)
        raw[3]["sampling"] = {name: value}
        try:
            validate(msgpack.packb(raw))
        except CodecError as exc:
            assert exc.field == f"sampling.{name}" and exc.code is m.RejectCode.INVALID
        else:
            raise AssertionError(f"{name}={value} was accepted")


valid_sampling = st.fixed_dictionaries(
    {},
    optional={
        "max_tokens": st.integers(1, 2**31), "temperature": st.floats(0, 100),
        "top_p": st.floats(0, 1, exclude_min=True), "top_k": st.integers(0, VOCAB),
        "min_p": st.floats(0, 1), "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1)),
        "ignore_eos": st.booleans(),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
        "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
        "repetition_penalty": st.floats(0, 10, exclude_min=True),
        "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    },
)
valid_prompts = st.one_of(
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=20)}),
    st.fixed_dictionaries({"prompt_ids": st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                  max_size=5)}),
    st.fixed_dictionaries({"messages": st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                               "content": st.text(max_size=5)}), min_size=1, max_size=2)}),
)


@settings(max_examples=400, deadline=None)
@given(prompt=valid_prompts, sampling=valid_sampling,
       request_id=st.text(min_size=1, max_size=5))
def test_every_valid_generate_is_accepted_with_its_values(prompt: dict, sampling: dict,
                                                          request_id: str) -> None:
    """A validator that refused everything would pass the test above; this one would not."""
    body = {"request_id": request_id, **prompt, "sampling": sampling}
    frame = msgpack.packb([m.PROTOCOL_MAJOR, 0, m.Generate.TAG, body], use_bin_type=True)
    params = validate(frame, Limits())  # valid under the default limits, not the tiny ones above
    for name, value in sampling.items():
        carried = getattr(params, name)
        assert (list(carried) if isinstance(carried, tuple) else carried) == value, name


def test_boundary_values_are_accepted() -> None:
    for name, value in [("temperature", 0.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                        ("min_p", 1.0), ("max_tokens", 1), ("seed", 0),
                        ("presence_penalty", -2.0), ("frequency_penalty", 2.0)]:
        raw = msgpack.unpackb(codec.encode(m.Generate("r", prompt="hi")))
        raw[3]["sampling"] = {name: value}
        assert getattr(validate(msgpack.packb(raw)), name) == value, name
