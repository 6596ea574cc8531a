"""Structured outputs through the official `openai` client, on the embedded model (the
session's `model_daemon`, float32): a JSON schema, a regex or a list of choices holds every
output that ends by `stop`, sampled or greedy, streamed or not, and across a worker killed
mid-generation; bad grammars, oversized ones and bad `logit_bias` values are a 400 naming
the field or the limit. The fixture checks the KV invariant after each test."""

from __future__ import annotations

import json
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
import trio

from sluice.actors.front.limits import Limits
from sluice.ipc.client import AsyncClient

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema",
                 "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


def client_for(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{daemon.http}/v1", api_key="unused", max_retries=0,
                         timeout=240)


async def test_sampled_json_schema_outputs_validate(model_daemon) -> None:
    client = client_for(model_daemon)
    model = (await trio.to_thread.run_sync(client.models.list)).data[0].id

    def one(seed: int):
        return client.chat.completions.create(model=model, messages=ASK, max_tokens=40,
                                              temperature=1.0, seed=seed,
                                              response_format=PERSON_FORMAT)

    def all_of_them():
        with ThreadPoolExecutor(32) as pool:
            return list(pool.map(one, range(32)))

    with trio.fail_after(300):
        answers = await trio.to_thread.run_sync(all_of_them)
    stopped = [a.choices[0].message.content for a in answers
               if a.choices[0].finish_reason == "stop"]
    assert len(stopped) >= 16, [a.choices[0].finish_reason for a in answers]
    for text in stopped:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(stopped)) > 1  # sampled, each with its own seed


async def test_streamed_and_whole_agree_and_other_grammars_hold(model_daemon) -> None:
    client = client_for(model_daemon)
    model = (await trio.to_thread.run_sync(client.models.list)).data[0].id

    def run():
        whole = client.chat.completions.create(model=model, messages=ASK, max_tokens=40,
                                               temperature=0, response_format=PERSON_FORMAT)
        streamed = list(client.chat.completions.create(
            model=model, messages=ASK, max_tokens=40, temperature=0,
            response_format=PERSON_FORMAT, stream=True))
        json_object = client.completions.create(
            model=model, prompt="A JSON object:", max_tokens=24, temperature=0.8, seed=5,
            extra_body={"response_format": {"type": "json_object"}})
        regex = client.completions.create(
            model=model, prompt="The year is", max_tokens=8, temperature=1.0, seed=3,
            extra_body={"guided_regex": r" (19|20)\d\d\."})
        choice = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Is water wet?"}],
            max_tokens=8, temperature=1.0, seed=9,
            extra_body={"guided_choice": ["yes", "no", "it depends"]})
        text = client.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0,
                                         extra_body={"response_format": {"type": "text"}})
        return whole, streamed, json_object, regex, choice, text

    with trio.fail_after(300):
        whole, streamed, json_object, regex, choice, text = await trio.to_thread.run_sync(run)
    content = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(content), PERSON)
    assert "".join(e.choices[0].delta.content or "" for e in streamed if e.choices) == content
    assert [e.choices[0].finish_reason for e in streamed if e.choices][-1] == "stop"
    if json_object.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(json_object.choices[0].text), dict)
    assert re.fullmatch(r" (19|20)\d\d\.", regex.choices[0].text)
    assert choice.choices[0].message.content in ("yes", "no", "it depends")
    assert text.choices[0].finish_reason in ("stop", "length")


async def test_the_constraint_holds_across_a_worker_kill(model_daemon) -> None:
    """Greedy and float32: the request recomputed in a new worker, its matcher and its
    penalties' ids rebuilt from the tokens it had, ends exactly as the uninterrupted one did."""
    client = client_for(model_daemon)
    model = (await trio.to_thread.run_sync(client.models.list)).data[0].id
    before = await model_daemon.status()
    # the worker keeps a penalized request's ids; the new one is sent them all again
    penalties = {"frequency_penalty": 0.3, "extra_body": {"repetition_penalty": 1.2}}

    def whole():
        return client.chat.completions.create(model=model, messages=ASK, max_tokens=40,
                                              temperature=0, response_format=PERSON_FORMAT,
                                              **penalties)

    first_chunk = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def streamed():
        parts = []
        for event in client.chat.completions.create(model=model, messages=ASK, max_tokens=40,
                                                    temperature=0, stream=True,
                                                    response_format=PERSON_FORMAT,
                                                    **penalties):
            if event.choices and event.choices[0].delta.content:
                parts.append(event.choices[0].delta.content)
                if len(parts) == 3:
                    trio.from_thread.run_sync(first_chunk.set, trio_token=token)
        return "".join(parts)

    with trio.fail_after(300):
        expected = (await trio.to_thread.run_sync(whole)).choices[0].message.content
        result: list[str] = []
        async with trio.open_nursery() as nursery:
            async def run() -> None:
                result.append(await trio.to_thread.run_sync(streamed))
            nursery.start_soon(run)
            await first_chunk.wait()
            os.kill(before.worker.pid, signal.SIGKILL)
    assert result[0] == expected
    jsonschema.validate(json.loads(result[0]), PERSON)
    after = await model_daemon.status()
    assert after.worker.restarts == before.worker.restarts + 1


async def test_bad_requests_name_the_field_or_the_limit(model_daemon) -> None:
    client = client_for(model_daemon)
    names = [m.id for m in (await trio.to_thread.run_sync(client.models.list)).data]
    model, alias = names[0], names[-1]
    limits = Limits()

    def refused(**kwargs) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model, messages=ASK, max_tokens=4, **kwargs)
        return caught.value

    def run():
        bad_schema = refused(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "nonsense"}}})
        huge = {"type": "object", "properties": {
            f"field_{i}": {"type": "string"} for i in range(limits.max_grammar_bytes // 20)}}
        too_large = refused(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": huge}})
        bad_regex = refused(extra_body={"guided_regex": "(unclosed"})
        two = refused(response_format={"type": "json_object"},
                      extra_body={"guided_choice": ["a"]})
        bias_range = refused(logit_bias={"42": 101})
        bias_vocab = refused(logit_bias={"999999999": 1})
        too_many = refused(logit_bias={str(i): 1 for i in range(limits.max_logit_bias + 1)})
        by_alias = client.completions.create(model=alias, prompt="The capital of France is",
                                             max_tokens=3, temperature=0)
        top = client.completions.create(model=model, prompt="The capital of France is",
                                        max_tokens=1, temperature=0, logprobs=1)
        return (bad_schema, too_large, bad_regex, two, bias_range, bias_vocab, too_many,
                by_alias, top)

    with trio.fail_after(240):
        (bad_schema, too_large, bad_regex, two, bias_range, bias_vocab, too_many, by_alias,
         top) = await trio.to_thread.run_sync(run)
    assert "nonsense" in bad_schema.message and bad_schema.param.startswith("response_format")
    assert "limits.max_grammar_bytes" in too_large.message
    assert bad_regex.param == "guided_regex" and "regex" in bad_regex.message
    assert "only one constraint" in two.message
    assert bias_range.param == "logit_bias" and "[-100, 100]" in bias_range.message
    assert bias_vocab.param == "logit_bias" and "vocabulary" in bias_vocab.message
    assert "limits.max_logit_bias" in too_many.message
    assert alias != model and by_alias.model == alias

    # a -100 bias on the greedy token takes it out of the race
    best = top.choices[0].logprobs.tokens[0]
    best_id = model_daemon_token_id(best)

    def biased():
        return client.completions.create(model=model, prompt="The capital of France is",
                                         max_tokens=1, temperature=0, logprobs=1,
                                         logit_bias={str(best_id): -100})

    other = await trio.to_thread.run_sync(biased)
    assert other.choices[0].logprobs.tokens[0] != best


def model_daemon_token_id(text: str) -> int:
    from sluice.actors.executor.model_files import resolve_model_path
    from sluice.actors.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_path(None))
    ids = tokenizer.backend.encode(text, add_special_tokens=False).ids
    assert len(ids) == 1, (text, ids)
    return ids[0]


async def test_n_choices_share_the_prompt_and_each_has_its_seed(model_daemon) -> None:
    client = client_for(model_daemon)
    model = (await trio.to_thread.run_sync(client.models.list)).data[0].id
    prompt = "Write a short story about a lighthouse keeper and the sea: " * 3

    def run():
        many = client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                         temperature=1.0, seed=11, n=4)
        one = client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                        temperature=1.0, seed=11)
        with pytest.raises(openai.BadRequestError) as streamed:
            client.completions.create(model=model, prompt=prompt, max_tokens=8, n=2,
                                      stream=True)
        with pytest.raises(openai.BadRequestError) as too_many:
            client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                      n=Limits().max_n + 1)
        return many, one, streamed.value, too_many.value

    with trio.fail_after(240):
        many, one, streamed, too_many = await trio.to_thread.run_sync(run)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    texts = [c.text for c in many.choices]
    assert texts[0] == one.choices[0].text  # choice 0 is the n = 1 answer
    assert len(set(texts)) > 1
    # the three later choices found the first one's full prompt blocks in the prefix cache
    block = 16
    shared = many.usage.prompt_tokens // block * block
    assert many.usage.prompt_tokens_details.cached_tokens >= 3 * (shared - block) > 0
    assert len(many.choices) <= many.usage.completion_tokens <= 4 * 8
    assert streamed.param == "n" and "limits.max_n" in too_many.message


async def test_the_zeromq_client_sends_a_schema_and_n_choices(model_daemon) -> None:
    async with AsyncClient(model_daemon.listen, daemon_timeout=120) as client:
        with trio.fail_after(240):
            whole = await (await client.generate(messages=ASK, max_tokens=40, temperature=0,
                                                 json_schema=PERSON)).collect()
            choices = await client.generate_choices("Pick a colour:", n=2, max_tokens=4,
                                                    temperature=1.0, seed=4,
                                                    choices=["red", "green", "blue"])
            picked = [(await c.collect()).text for c in choices]
    assert whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.text), PERSON)
    assert all(p in ("red", "green", "blue") for p in picked)
