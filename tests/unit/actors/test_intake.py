"""`check_generate`: each request-level limit refuses one over it, with its code and field,
and accepts a request exactly at it."""

from __future__ import annotations

import pytest

from sluice.actors.front.intake import check_generate
from sluice.actors.front.limits import Limits
from sluice.ipc import messages as m

LIMITS = Limits(max_request_id_chars=8, max_tenant_chars=7, max_prompt_chars=20,
                max_messages=2, max_stop_strings=2, max_stop_string_chars=3)
INVALID, TOO_LONG = m.RejectCode.INVALID, m.RejectCode.TOO_LONG


def chat(*contents: str) -> tuple[m.ChatMessage, ...]:
    return tuple(m.ChatMessage("user", content) for content in contents)


def stops(*strings: str) -> m.SamplingParams:
    return m.SamplingParams(stop=strings)


# (fields exactly at a limit, the same one step over it, code, field, limit name)
CASES = [
    (dict(request_id="r" * 8), dict(request_id="r" * 9), INVALID, "request_id",
     "max_request_id_chars"),
    (dict(tenant="default"), dict(tenant="default!"), INVALID, "tenant", "max_tenant_chars"),
    (dict(prompt="p" * 20), dict(prompt="p" * 21), TOO_LONG, "prompt", "max_prompt_chars"),
    # "user" is 4 characters of each message: the role is rendered into the prompt too
    (dict(prompt=None, messages=chat("a" * 6, "b" * 6)),
     dict(prompt=None, messages=chat("a" * 6, "b" * 7)), TOO_LONG, "messages", "max_prompt_chars"),
    (dict(prompt=None, messages=chat("a", "b")), dict(prompt=None, messages=chat("a", "b", "c")),
     INVALID, "messages", "max_messages"),
    (dict(sampling=stops("x", "y")), dict(sampling=stops("x", "y", "z")), INVALID,
     "sampling.stop", "max_stop_strings"),
    (dict(sampling=stops("x", "yyy")), dict(sampling=stops("x", "yyyy")), INVALID,
     "sampling.stop[1]", "max_stop_string_chars"),
]


@pytest.mark.parametrize(("at", "over", "code", "field", "limit"), CASES,
                         ids=[case[-1] + ":" + case[3] for case in CASES])
def test_over_a_limit_is_refused_and_at_it_is_accepted(at, over, code, field, limit) -> None:
    base = dict(request_id="r", prompt="hi")
    assert check_generate(m.Generate(**{**base, **at}), LIMITS) is None
    refused = check_generate(m.Generate(**{**base, **over}), LIMITS)
    assert refused is not None
    assert (refused.code, refused.field) == (code, field)
    assert f"limits.{limit} = {getattr(LIMITS, limit)}" in refused.message
    assert refused.request_id == over.get("request_id", "r")


def test_token_id_prompts_are_left_to_the_model_context() -> None:
    assert check_generate(m.Generate("r", prompt_ids=(1,) * 10_000), LIMITS) is None


def test_the_default_limits_take_a_large_ordinary_request() -> None:
    request = m.Generate("r" * 128, messages=chat("x" * 100_000) * 8,
                         sampling=stops(*("s" * 256 for _ in range(16))))
    assert check_generate(request, Limits()) is None
