"""Everything a client can put in a Generate is either accepted or refused with the field named.

This is the daemon's validation path without sockets: the codec, then the intake limits the
Stream checks (small ones here, so that they are hit), then the checks the Tokenizer actor
makes before tokenizing. Hypothesis drives well over a thousand cases.
"""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.actors.scheduler.plan import InvalidParams, SamplingParams
from sluice.actors.intake import check_generate, check_prompt_form, sampling_from_wire
from sluice.actors.limits import Limits
from sluice.ipc import messages as m
from sluice.ipc.codec import Codec, CodecError

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


def validate(frame: bytes) -> SamplingParams:
    msg = codec.decode(frame)
    refused = check_generate(msg, LIMITS)
    if refused is not None:
        raise OverLimit(refused)
    check_prompt_form(msg, VOCAB)
    return sampling_from_wire(msg.sampling)


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
        except InvalidParams as exc:
            assert exc.field == name
        else:
            raise AssertionError(f"{name}={value} was accepted")
