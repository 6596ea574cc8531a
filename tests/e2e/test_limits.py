"""Request-level intake limits through a live daemon on the null executor.

Each limit is set small, then a request just over it must get the right `Rejected` naming
the field, and a request exactly at it must be accepted and finish. Requests go over a raw
DEALER socket (the client library picks its own request ids) or through `AsyncClient`.
The `null_daemon` fixture checks the KV invariant after each test.
"""

from __future__ import annotations

import pytest
import trio
import zmq

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.codec import Codec
from sluice.ipc.vocabulary import InvalidRequestError, TooLongError
from sluice.ipc.sockets import Socket

client_codec = Codec(m.CLIENT_MESSAGES)
server_codec = Codec(m.SERVER_MESSAGES)


async def outcomes(address: str, requests: list[m.Generate]) -> dict[str, object]:
    """Send every request on one connection; each one's `Rejected` or `Finished`, by id."""
    ended: dict[str, object] = {}
    with Socket(zmq.DEALER) as sock:
        sock.connect(address)
        for request in requests:
            await sock.send(client_codec.encode(request))
        while len(ended) < len(requests):
            for msg in server_codec.decode_batch(await sock.recv()):
                if isinstance(msg, (m.Rejected, m.Finished)):
                    ended[msg.request_id] = msg
    return ended


def generate(request_id: str, prompt: str | None = "hi", **fields) -> m.Generate:
    sampling = fields.pop("sampling", m.SamplingParams(max_tokens=3))
    return m.Generate(request_id, prompt=prompt, sampling=sampling, **fields)


def assert_rejected(outcome: object, code: m.RejectCode, field: str, limit_name: str) -> None:
    assert isinstance(outcome, m.Rejected), outcome
    assert (outcome.code, outcome.field) == (code, field)
    assert f"limits.{limit_name}" in outcome.message


def assert_finished(outcome: object) -> None:
    assert isinstance(outcome, m.Finished), outcome
    assert outcome.reason in (m.FinishReason.LENGTH, m.FinishReason.STOP)
    assert outcome.usage.prompt_tokens > 0


async def test_request_id_length(null_daemon) -> None:
    daemon = await null_daemon(**{"limits.max_request_id_chars": 32})
    at, over = "a" * 32, "b" * 33
    with trio.fail_after(20):
        ended = await outcomes(daemon.listen, [generate(over), generate(at)])
    assert_rejected(ended[over], m.RejectCode.INVALID, "request_id", "max_request_id_chars")
    assert_finished(ended[at])


async def test_tenant_length(null_daemon) -> None:
    # "default" is the tenant every daemon knows: at the limit it must be served
    daemon = await null_daemon(**{"limits.max_tenant_chars": len("default")})
    with trio.fail_after(20):
        ended = await outcomes(daemon.listen, [generate("over", tenant="default+"),
                                               generate("at", tenant="default")])
    assert_rejected(ended["over"], m.RejectCode.INVALID, "tenant", "max_tenant_chars")
    assert_finished(ended["at"])


async def test_prompt_characters(null_daemon) -> None:
    daemon = await null_daemon(**{"limits.max_prompt_chars": 100})
    with trio.fail_after(20):
        async with AsyncClient(daemon.listen) as client:
            with pytest.raises(TooLongError) as refused:
                await client.generate("x" * 101, max_tokens=3)
            assert refused.value.field == "prompt"
            assert "limits.max_prompt_chars" in refused.value.message
            at = await client.generate("y" * 100, max_tokens=3)
            assert (await at.collect()).finish_reason == "length"


async def test_chat_prompt_characters_count_every_message(null_daemon) -> None:
    daemon = await null_daemon(**{"limits.max_prompt_chars": 100})
    # roles are rendered into the prompt too, so they count: 4 + 46 + 4 + 46 = 100
    at = [{"role": "user", "content": "u" * 46}, {"role": "user", "content": "v" * 46}]
    over = [{"role": "user", "content": "u" * 46}, {"role": "user", "content": "v" * 47}]
    with trio.fail_after(20):
        async with AsyncClient(daemon.listen) as client:
            with pytest.raises(TooLongError) as refused:
                await client.generate(messages=over, max_tokens=3)
            assert refused.value.field == "messages"
            done = await (await client.generate(messages=at, max_tokens=3)).collect()
            assert done.finish_reason == "length"


async def test_number_of_chat_messages(null_daemon) -> None:
    daemon = await null_daemon(**{"limits.max_messages": 3})
    turn = {"role": "user", "content": "hi"}
    with trio.fail_after(20):
        async with AsyncClient(daemon.listen) as client:
            with pytest.raises(InvalidRequestError) as refused:
                await client.generate(messages=[turn] * 4, max_tokens=3)
            assert refused.value.field == "messages"
            assert "limits.max_messages" in refused.value.message
            done = await (await client.generate(messages=[turn] * 3, max_tokens=3)).collect()
            assert done.finish_reason == "length"


async def test_number_of_stop_strings(null_daemon) -> None:
    daemon = await null_daemon(**{"limits.max_stop_strings": 2})
    with trio.fail_after(20):
        async with AsyncClient(daemon.listen) as client:
            with pytest.raises(InvalidRequestError) as refused:
                await client.generate("hi", max_tokens=3, stop=["x1", "x2", "x3"])
            assert refused.value.field == "sampling.stop"
            assert "limits.max_stop_strings" in refused.value.message
            # the null model says " the quick brown fox ...": the second stop string ends it
            done = await (await client.generate("hi", max_tokens=30,
                                                stop=["zzz", "brown"])).collect()
            assert done.finish_reason == "stop" and done.text == " the quick "


async def test_length_of_a_stop_string(null_daemon) -> None:
    daemon = await null_daemon(**{"limits.max_stop_string_chars": 5})
    with trio.fail_after(20):
        async with AsyncClient(daemon.listen) as client:
            with pytest.raises(InvalidRequestError) as refused:
                await client.generate("hi", max_tokens=3, stop=["ok", "brown"[:4] + "xy"])
            assert refused.value.field == "sampling.stop[1]"
            assert "limits.max_stop_string_chars" in refused.value.message
            done = await (await client.generate("hi", max_tokens=30, stop=["brown"])).collect()
            assert done.finish_reason == "stop" and done.text == " the quick "


async def test_defaults_accept_an_ordinary_request(null_daemon) -> None:
    daemon = await null_daemon()
    with trio.fail_after(20):
        ended = await outcomes(daemon.listen, [generate(
            "r" * 128, prompt="p" * 5000, tenant="default",
            sampling=m.SamplingParams(max_tokens=3, stop=tuple("s" * 256 for _ in range(16))))])
    assert_finished(ended["r" * 128])
