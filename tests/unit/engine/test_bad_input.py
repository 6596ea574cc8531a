"""Bad input gets a clear error naming what is wrong, and the engine keeps serving."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sluice.ipc.vocabulary import RejectedError
from sluice.ipc.vocabulary import InvalidParams, SamplingParams
from sluice.ipc.vocabulary import RejectCode

GOOD = SamplingParams(max_tokens=3, temperature=0.0)


def assert_still_serves(engine):
    [completion] = engine.generate(["Hello"], GOOD)
    assert len(completion.token_ids) == 3 and completion.finish_reason == "length"


@pytest.mark.parametrize("prompt, field_name", [
    ({"prompt": ""}, "prompt"),
    ({"prompt_token_ids": []}, "prompt"),
    ({"prompt_token_ids": [1, -5]}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, 10**9]}, "prompt_token_ids"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": []}, "messages"),
])
def test_bad_prompts_are_rejected_by_name(make_engine, prompt, field_name):
    engine = make_engine()
    with pytest.raises(RejectedError) as info:
        engine.add_request(sampling=GOOD, **prompt)
    assert info.value.code is RejectCode.INVALID
    assert field_name in str(info.value)
    assert_still_serves(engine)


def test_a_prompt_longer_than_the_context_is_rejected_as_too_long(make_engine):
    engine = make_engine()
    too_long = [1] * (engine.max_model_len + 10)
    with pytest.raises(RejectedError) as info:
        engine.add_request(prompt_token_ids=too_long, sampling=GOOD)
    assert info.value.code is RejectCode.TOO_LONG
    assert str(engine.max_model_len) in str(info.value)
    assert_still_serves(engine)


@pytest.mark.parametrize("field_name, value", [
    ("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.01), ("top_k", -1),
])
def test_bad_sampling_values_are_rejected_by_name(make_engine, field_name, value):
    engine = make_engine()
    with pytest.raises(InvalidParams, match=field_name):
        engine.add_request("Hello", sampling=SamplingParams.from_dict({field_name: value}))
    assert_still_serves(engine)


def test_the_valid_edge_of_each_checked_value_is_accepted(make_engine):
    """Each check above refuses only past its edge: the edge itself generates."""
    engine = make_engine()
    vocab = engine.runner.config.vocab_size
    for prompt in ({"prompt": "x"}, {"prompt_token_ids": [0, vocab - 1]},
                   {"messages": [{"role": "user", "content": "hi"}]}):
        request_id = engine.add_request(sampling=SamplingParams(max_tokens=1), **prompt)
        assert request_id is not None, prompt
    for field_name, value in [("max_tokens", 1), ("temperature", 0.0), ("top_p", 1.0),
                              ("top_p", 1e-6), ("top_k", 0)]:
        params = SamplingParams.from_dict({"max_tokens": 2, field_name: value})
        engine.add_request("Hello", sampling=params)
    while engine.has_unfinished():
        engine.step()
    assert_still_serves(engine)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluice.daemon.cli", "generate", "--offline",
                           *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, needle", [
    (["--model", "/nonexistent/model.gguf", "--prompt", "hi"], "/nonexistent/model.gguf"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature"),
    (["--prompt", "hi", "--top-p", "2"], "top_p"),
    (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
    (["--prompt-ids", "1,x,3"], "--prompt-ids"),
])
def test_the_cli_names_the_bad_value_and_exits_2(args, needle):
    result = run_cli(*args)
    assert result.returncode == 2
    assert needle in result.stderr
    assert "Traceback" not in result.stderr


def test_the_cli_rejects_a_corrupt_gguf_by_file_name(tmp_path, smollm_path):
    broken = tmp_path / "truncated.gguf"
    broken.write_bytes(smollm_path.read_bytes()[:4096])
    result = run_cli("--model", str(broken), "--prompt", "hi")
    assert result.returncode == 2 and "truncated.gguf" in result.stderr


@pytest.mark.slow
def test_the_cli_answers_a_chat_question_with_json():
    result = run_cli("--chat", "What is the capital of France?", "--max-tokens", "24", "--json")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert "Paris" in answer["text"]
    assert answer["finish_reason"] in ("stop", "length")
    assert answer["usage"]["completion_tokens"] == len(answer["token_ids"]) > 0
    assert answer["usage"]["prompt_tokens"] > 10
