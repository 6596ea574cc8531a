"""The client protocol against a daemon on the null executor: real sockets, real actors."""

from __future__ import annotations

import msgpack
import pytest
import trio
import zmq

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.codec import Codec
from sluice.ipc.vocabulary import InvalidRequestError, TooLongError
from sluice.ipc.sockets import Socket

NULL_TEXT = " the quick brown fox jumps over the lazy dog"


async def test_stream_delivers_every_token_then_one_finished(null_daemon) -> None:
    daemon = await null_daemon()
    with trio.fail_after(20):
        async with AsyncClient(daemon.listen, credit_window=2) as client:
            info = await client.status()
            assert info.protocol_version == m.PROTOCOL_VERSION and "null" in info.model
            generation = await client.generate("hi", max_tokens=12, temperature=0)
            chunks = [chunk async for chunk in generation]
            result = generation.result
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 12 == result.usage.completion_tokens
    assert "".join(c.text for c in chunks) == result.text
    assert result.text.startswith(NULL_TEXT)
    assert result.usage.prompt_tokens == generation.prompt_tokens > 0


async def test_cancel_mid_stream_frees_blocks_in_next_snapshot(null_daemon) -> None:
    daemon = await null_daemon()
    with trio.fail_after(20):
        async with AsyncClient(daemon.listen, credit_window=1) as client:
            generation = await client.generate("hi", max_tokens=4000, temperature=0)
            async for _ in generation:
                if (await daemon.status()).kv.used_blocks > 0:
                    break
            await generation.cancel()
            async for _ in generation:
                pass
            assert generation.result.finish_reason == "cancelled"
            report = await daemon.status()
            assert report.kv.used_blocks == 0
            assert report.counters.cancelled == 1


async def test_stop_string_across_tokens_is_never_sent(null_daemon) -> None:
    daemon = await null_daemon()
    with trio.fail_after(20):
        async with AsyncClient(daemon.listen) as client:
            generation = await client.generate("hi", max_tokens=30, stop=["fox jum"])
            texts = [chunk.text async for chunk in generation]
    assert generation.result.finish_reason == "stop"
    assert generation.result.text == " the quick brown "
    assert all("f" not in text for text in texts)  # not even the start of the stop string


async def test_multibyte_characters_never_break_across_chunks(null_daemon) -> None:
    text = " 日本語のテキスト 😀🎉 café ñandú Ωμέγα"
    daemon = await null_daemon(**{"null.text": text})
    with trio.fail_after(20):
        async with AsyncClient(daemon.listen, credit_window=64) as client:
            generation = await client.generate("hi", max_tokens=60, temperature=0)
            texts = [chunk.text async for chunk in generation]
    assert all("\ufffd" not in t for t in texts)
    assert "".join(texts).startswith(text)
    # tokens that carry part of a character came as chunks with no text
    assert any(t == "" for t in texts)


async def test_typed_rejections_name_the_field(null_daemon) -> None:
    daemon = await null_daemon(**{"null.max_model_len": 64})
    with trio.fail_after(20):
        async with AsyncClient(daemon.listen) as client:
            with pytest.raises(InvalidRequestError) as invalid:
                await client.generate("hi", top_p=7.0)
            assert invalid.value.field == "sampling.top_p"
            with pytest.raises(TooLongError) as too_long:
                await client.generate(prompt_ids=[5] * 100)
            assert too_long.value.field == "prompt_ids"  # what this client sent
            with pytest.raises(TooLongError) as too_long:
                await client.generate("hi " * 100)
            assert too_long.value.field == "prompt"
            with pytest.raises(InvalidRequestError) as both:
                await client.generate("hi", prompt_ids=[1])
            assert both.value.field == "prompt"
            ok = await client.generate("still serving", max_tokens=3)
            assert (await ok.collect()).finish_reason == "length"


async def raw_exchange(address: str, frames: list[bytes]) -> list[m.Rejected]:
    codec = Codec(m.SERVER_MESSAGES)
    answers = []
    with Socket(zmq.DEALER) as sock:
        sock.connect(address)
        for frame in frames:
            await sock.send(frame)
            answers.append(codec.decode(await sock.recv()))
    return answers


async def test_malformed_frames_over_the_socket_get_rejected(null_daemon) -> None:
    daemon = await null_daemon()
    frames = [
        b"\x00\xff garbage",
        msgpack.packb([m.PROTOCOL_MAJOR + 1, 0, 1, {"request_id": "v"}]),
        msgpack.packb([m.PROTOCOL_MAJOR, 0, 77, {}]),
        msgpack.packb([m.PROTOCOL_MAJOR, 0, 1, {"prompt": "no id"}]),
        msgpack.packb([m.PROTOCOL_MAJOR, 0, 1, {"request_id": "t", "priority": "high"}]),
        msgpack.packb([m.PROTOCOL_MAJOR, 0, 1, {"request_id": "s", "prompt": "a",
                                                "sampling": {"max_tokens": -5}}]),
        b"\x91" + b"\xc4\x00" * 10,
    ]  # an oversize frame costs its peer the connection instead: tests/faults/test_intake.py
    with trio.fail_after(20):
        answers = await raw_exchange(daemon.listen, frames)
    assert all(isinstance(a, m.Rejected) for a in answers)
    assert [a.field for a in answers] == [
        "frame", "version", "tag", "request_id", "priority", "sampling.max_tokens", "frame",
    ]
    assert answers[1].code is m.RejectCode.PROTOCOL_VERSION
    async with AsyncClient(daemon.listen) as client:
        with trio.fail_after(20):
            assert (await (await client.generate("ok", max_tokens=2)).collect()).token_ids
