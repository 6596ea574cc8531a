"""One request's data never takes down a shared actor.

Hostile values on either front (integers past 64 bits, a chat template that raises, a
prompt of millions of token ids) are refused at the edge with the field named, while another
client's request streams on to its normal end; the Scheduler and the Tokenizer are never
restarted. Past the edge, a request whose own data still breaks the Scheduler's work ends
alone with an error. The `null_daemon` fixture checks the KV invariant after each test.
"""

from __future__ import annotations

import http.client
import json

import msgpack
import pytest
import trio

from sluice.actors.text import load_tokenizer
from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.vocabulary import InvalidRequestError
from sluice.ipc.vocabulary import SamplingParams

from support.raw_peer import RawPeer

BIG = 2**64  # one past what msgpack carries
MODEL = "null (fake tokens)"
# roles must alternate user/assistant, as Mistral's, Llama 2's and Gemma's templates demand
STRICT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
    "{% endif %}[{{ message['role'] }}] {{ message['content'] }}\n"
    "{% endfor %}[assistant] "
)


async def post(handle, path: str, body: bytes | dict) -> tuple[int, dict]:
    """POST a JSON body (bytes are sent as they are): (status, the decoded answer)."""
    raw = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()

    def exchange() -> tuple[int, dict]:
        host, port = handle.http.rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            connection.request("POST", path, body=raw,
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, json.loads(response.read() or b"null")
        finally:
            connection.close()

    return await trio.to_thread.run_sync(exchange)


async def http_daemon(null_daemon, **overrides):
    handle = await null_daemon(**{"http.listen": "127.0.0.1:0", **overrides})
    handle.http = handle.daemon.http_address
    return handle


def no_restarts(daemon) -> None:
    assert {name: n for name, n in daemon.supervisor.restarts.items()
            if name in ("scheduler", "tokenizer", "http")} == {}


async def tenant_stream(client: AsyncClient, max_tokens: int = 40):
    """Another client's request, started and holding KV: it has sent its first chunk, and
    waits (its credits spent) while the test goes on."""
    generation = await client.generate("a steady stream", max_tokens=max_tokens,
                                       ignore_eos=True)
    first = await generation.__anext__()
    assert first.token_ids
    return generation


async def finishes_normally(generation, max_tokens: int = 40) -> None:
    result = await generation.collect()
    assert result.finish_reason == "length", result
    assert result.usage.completion_tokens == max_tokens


def frame(**generate) -> bytes:
    """A `Generate` frame as a hostile client packs it: no library checks on the way."""
    return msgpack.packb([m.PROTOCOL_MAJOR, m.PROTOCOL_MINOR, m.Generate.TAG, generate])


async def test_integers_past_64_bits_are_refused_and_cost_no_one_else(null_daemon) -> None:
    handle = await http_daemon(null_daemon)
    completions = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    hostile = [
        ("/v1/completions", {**completions, "seed": BIG}, "seed"),
        ("/v1/completions", {**completions, "max_tokens": BIG}, "max_tokens"),
        ("/v1/chat/completions", {**chat, "max_completion_tokens": BIG},
         "max_completion_tokens"),
        ("/v1/completions", {**completions, "top_k": BIG}, "top_k"),
        ("/v1/chat/completions", {**chat, "priority": BIG}, "priority"),
        ("/v1/completions", {**completions, "priority": -BIG}, "priority"),
        ("/v1/completions", {**completions, "timeout": 10**400}, "timeout"),
        ("/v1/completions", {**completions, "temperature": 10**400}, "temperature"),
        ("/v1/completions", {**completions, "logprobs": BIG}, "logprobs"),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": BIG},
         "top_logprobs"),
        ("/v1/completions", {**completions, "prompt": [1, BIG]}, "prompt"),
        ("/v1/completions", {**completions, "seed": 2**63}, "seed"),
    ]
    with trio.fail_after(60):
        async with AsyncClient(handle.listen, credit_window=1) as client:
            running = await tenant_stream(client)
            for path, body, param in hostile:
                status, answer = await post(handle, path, body)
                assert (status, answer["error"]["param"]) == (400, param), (body, answer)
            # the ZeroMQ front: values msgpack carries, past what a request may
            with RawPeer(handle.listen) as peer:
                for field, sampling, priority in [
                    ("sampling.seed", {"seed": 2**64 - 1}, 0),
                    ("sampling.max_tokens", {"max_tokens": 2**63}, 0),
                    ("sampling.top_k", {"top_k": 2**64 - 1}, 0),
                    ("sampling.stop_token_ids[0]", {"stop_token_ids": [2**64 - 1]}, 0),
                    ("priority", {}, 2**64 - 1),
                ]:
                    await peer.socket.send(frame(request_id=field, prompt="hi",
                                                 sampling=sampling, priority=priority))
                    [refused] = await peer.until_finished(field)
                    assert isinstance(refused, m.Rejected), refused
                    assert (refused.code, refused.field) == (m.RejectCode.INVALID, field)
            await finishes_normally(running)
            # the largest values a request may carry are served
            status, answer = await post(handle, "/v1/completions", {
                **completions, "seed": 2**63 - 1, "priority": 2**63 - 1})
            assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
    no_restarts(handle.daemon)


@pytest.fixture
def strict_template_model(tmp_path, smollm_tokenizer):
    """A model folder as transformers writes one, whose chat template calls
    `raise_exception` for roles that do not alternate."""
    folder = tmp_path / "strict-model"
    folder.mkdir()
    smollm_tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": STRICT_TEMPLATE, "eos_token": "<|im_end|>"}))
    assert load_tokenizer(folder).chat_template == STRICT_TEMPLATE
    return folder


async def test_a_chat_template_that_raises_refuses_its_request_only(
        null_daemon, strict_template_model) -> None:
    handle = await http_daemon(null_daemon, model=str(strict_template_model))
    model = handle.daemon.http.model_name
    twice = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
    with trio.fail_after(60):
        async with AsyncClient(handle.listen, credit_window=1) as client:
            running = await tenant_stream(client)
            # more than the restart budget of the Tokenizer: it would have escalated
            for _ in range(handle.daemon.supervisor.policy.max_restarts + 2):
                status, answer = await post(handle, "/v1/chat/completions",
                                            {"model": model, "messages": twice})
                assert (status, answer["error"]["param"]) == (400, "messages"), answer
                assert "roles must alternate" in answer["error"]["message"]
                with pytest.raises(InvalidRequestError) as refused:
                    await client.generate(messages=twice, max_tokens=2)
                assert refused.value.field == "messages"
                assert "roles must alternate" in str(refused.value)
            await finishes_normally(running)
            alternating = [{"role": "user", "content": "hi"}]
            served = await (await client.generate(messages=alternating,
                                                  max_tokens=3)).collect()
            assert served.finish_reason == "length"
    no_restarts(handle.daemon)


async def test_a_prompt_of_millions_of_ids_is_refused_by_its_length(null_daemon) -> None:
    handle = await http_daemon(null_daemon)
    context = handle.daemon.http.max_model_len
    # an id outside the vocabulary at the end: refused for its length, not for that id,
    # since the length is checked before any id is looked at
    ids = [1] * 2_000_000 + [10**6]
    with trio.fail_after(60):
        async with AsyncClient(handle.listen, credit_window=1) as client:
            running = await tenant_stream(client)
            status, answer = await post(handle, "/v1/completions",
                                        {"model": MODEL, "prompt": ids, "max_tokens": 1})
            assert status == 400, answer
            assert (answer["error"]["param"], answer["error"]["code"]) == (
                "prompt", "context_length_exceeded")
            assert f"max_model_len {context}" in answer["error"]["message"]
            with RawPeer(handle.listen) as peer:
                # past limits.max_frame_items: refused at the array's header, undecoded
                await peer.socket.send(frame(request_id="huge", prompt_ids=[1] * 4_000_000
                                             + [10**6], sampling={"max_tokens": 1}))
                [refused] = await peer.until_finished("huge")
                assert isinstance(refused, m.Rejected), refused
                assert (refused.code, refused.field) == (m.RejectCode.TOO_LONG, "prompt_ids")
                assert "4000001 items exceed limits.max_frame_items" in refused.message
                # within it, past the context: the Tokenizer refuses it by its length alone
                await peer.socket.send(frame(request_id="long", prompt_ids=[1] * 500_000
                                             + [10**6], sampling={"max_tokens": 1}))
                [refused] = await peer.until_finished("long")
            assert isinstance(refused, m.Rejected), refused
            assert (refused.code, refused.field) == (m.RejectCode.TOO_LONG, "prompt_ids")
            assert "500001 tokens" in refused.message
            await finishes_normally(running)
            # one at the context's edge still gets its ids checked
            with pytest.raises(InvalidRequestError) as refused_id:
                await client.generate(prompt_ids=[1] * (context - 2) + [10**6], max_tokens=1)
            assert refused_id.value.field == f"prompt_ids[{context - 2}]"
    no_restarts(handle.daemon)


async def test_a_request_whose_values_cannot_reach_the_worker_ends_alone(
        null_daemon, monkeypatch) -> None:
    """The last line of defence: with the edge's range checks gone, a seed no wire carries
    gets as far as the first socket between actors; that request ends with an error, and
    the front, with every other request, goes on without a restart."""
    handle = await http_daemon(null_daemon)
    monkeypatch.setattr(SamplingParams, "validate", lambda self: None)
    with trio.fail_after(60):
        async with AsyncClient(handle.listen, credit_window=1) as client:
            running = await tenant_stream(client)
            for _ in range(handle.daemon.supervisor.policy.max_restarts + 2):
                status, answer = await post(handle, "/v1/completions", {
                    "model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": BIG})
                assert (status, answer["error"]["code"]) == (500, "error"), answer
                assert "failed in the HTTP front" in answer["error"]["message"]
            await finishes_normally(running)
            status, answer = await post(handle, "/v1/completions", {
                "model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": 7})
            assert status == 200, answer
    no_restarts(handle.daemon)
