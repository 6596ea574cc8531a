"""The HTTP front on the embedded model (the session's `model_daemon`, float32): greedy
output through the official `openai` client equals the ZeroMQ client's for the same prompt,
chat and raw, and its logprobs equal the offline engine's. The fixture checks the KV
invariant after each test."""

from __future__ import annotations

import math

import openai
import trio

from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status
from sluice.ipc.vocabulary import SamplingParams

CHAT = [{"role": "user", "content": "Name three rivers in Europe."}]
PROMPT = "The capital of France is"


async def test_greedy_output_is_the_same_through_both_fronts(model_daemon) -> None:
    client = openai.OpenAI(base_url=f"http://{model_daemon.http}/v1", api_key="unused",
                           max_retries=0, timeout=120)

    def over_http():
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12,
                                              temperature=0)
        streamed = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                                  temperature=0, stream=True))
        return chat, streamed

    with trio.fail_after(240):
        chat, streamed = await trio.to_thread.run_sync(over_http)
        async with AsyncClient(model_daemon.listen, daemon_timeout=120) as native:
            native_chat = await (await native.generate(messages=CHAT, max_tokens=12,
                                                       temperature=0)).collect()
            native_raw = await (await native.generate(PROMPT, max_tokens=12,
                                                      temperature=0)).collect()
    assert chat.choices[0].message.content == native_chat.text
    assert chat.choices[0].finish_reason == native_chat.finish_reason
    assert chat.usage.completion_tokens == len(native_chat.token_ids)
    assert chat.usage.prompt_tokens == native_chat.usage.prompt_tokens
    assert "".join(event.choices[0].text for event in streamed) == native_raw.text
    assert streamed[-1].choices[0].finish_reason == native_raw.finish_reason
    assert native_raw.text.strip()  # the model said something to compare


async def test_a_seeded_sampled_request_repeats_while_others_load_the_daemon(model_daemon) -> None:
    client = openai.OpenAI(base_url=f"http://{model_daemon.http}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    model = (await trio.to_thread.run_sync(client.models.list)).data[0].id

    def seeded() -> str:
        done = client.completions.create(model=model, prompt="Once upon a time", max_tokens=12,
                                         temperature=0.9, top_p=0.95, seed=1234)
        return done.choices[0].text

    async def load(results: list) -> None:
        async with AsyncClient(model_daemon.listen, daemon_timeout=120) as native:
            for i in range(3):
                results.append(await (await native.generate(
                    f"Tell me about the number {i}.", max_tokens=12, temperature=1.0)).collect())

    with trio.fail_after(240):
        alone = await trio.to_thread.run_sync(seeded)
        loaded: list = []
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(load, loaded)
            # the load is running when the seeded request arrives
            while (await fetch_status(model_daemon.control)).requests.running == 0:
                await trio.sleep(0.02)
            again = await trio.to_thread.run_sync(seeded)
    assert again == alone and alone.strip()
    assert len(loaded) == 6


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, abs_tol=1e-4)


async def test_logprobs_equal_the_offline_engine_s_on_both_fronts(model_daemon,
                                                                  offline_greedy) -> None:
    client = openai.OpenAI(base_url=f"http://{model_daemon.http}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    greedy = dict(max_tokens=10, temperature=0)

    def over_http():
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=CHAT, logprobs=True,
                                              top_logprobs=3, **greedy)
        streamed = list(client.completions.create(model=model, prompt=PROMPT, logprobs=2,
                                                  stream=True, **greedy))
        return chat, streamed

    def offline():  # the engine's own log-softmax of the same greedy requests, in-process
        engine = offline_greedy.engine
        chat = engine.generate([CHAT], SamplingParams(logprobs=3, **greedy), chat=True)[0]
        raw = engine.generate([PROMPT], SamplingParams(logprobs=2, **greedy))[0]
        return chat, raw

    with trio.fail_after(240):
        (chat, streamed), (offline_chat, offline_raw) = (
            await trio.to_thread.run_sync(over_http), await trio.to_thread.run_sync(offline))
        async with AsyncClient(model_daemon.listen, daemon_timeout=120,
                               credit_window=2) as native:
            generation = await native.generate(PROMPT, logprobs=True, top_logprobs=2, **greedy)
            await trio.sleep(1.0)  # its chunks back up behind the small window and merge
            chunks = [chunk async for chunk in generation]
    # chat, not streamed: each token's logprob and its three alternatives
    content = chat.choices[0].logprobs.content
    assert [t.token for t in content] == [t.token for t in offline_chat.logprobs]
    for got, want in zip(content, offline_chat.logprobs, strict=True):
        assert close(got.logprob, want.logprob)
        assert [a.token for a in got.top_logprobs] == [a.token for a in want.top]
        assert all(close(a.logprob, b.logprob) for a, b in zip(got.top_logprobs, want.top))
        assert got.top_logprobs[0].token == got.token  # greedy took the likeliest
    # completions, streamed: the legacy columns, event by event
    tokens = [t for e in streamed if e.choices[0].logprobs for t in e.choices[0].logprobs.tokens]
    values = [v for e in streamed if e.choices[0].logprobs
              for v in e.choices[0].logprobs.token_logprobs]
    assert tokens == [t.token for t in offline_raw.logprobs]
    assert all(close(a, b.logprob) for a, b in zip(values, offline_raw.logprobs, strict=True))
    # ZeroMQ: merged chunks keep one entry per token, in order
    assert any(len(c.token_ids) > 1 for c in chunks), "no chunk was merged"
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks if c.token_ids)
    result = generation.result
    assert result.token_ids == offline_raw.token_ids
    for got, want in zip(result.logprobs, offline_raw.logprobs, strict=True):
        assert got.token == want.token and close(got.logprob, want.logprob)
        assert [a.token_id for a in got.top] == [a.token_id for a in want.top]
