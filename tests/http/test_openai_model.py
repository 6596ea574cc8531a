"""The HTTP front on the embedded model (the session's `model_daemon`, float32): greedy
output through the official `openai` client equals the ZeroMQ client's for the same prompt,
chat and raw. The fixture checks the KV invariant after each test."""

from __future__ import annotations

import openai
import trio

from sluice.ipc.client import AsyncClient

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
            await trio.sleep(0.2)  # the load is running when the seeded request arrives
            again = await trio.to_thread.run_sync(seeded)
    assert again == alone and alone.strip()
    assert len(loaded) == 6
