"""The client library's credits: a window topped up as chunks are taken, none beyond what a
request can still bring, and never a request left waiting for credit.

A scripted ROUTER in the test stands in for the daemon (a named fake: the daemon's own credit
handling is covered by the end-to-end backpressure tests). It spends credits as the daemon's
Stream does, a chunk per credit, and holds the rest until a Credit comes.
"""

from __future__ import annotations

import pytest
import trio
import zmq

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.codec import Codec
from sluice.ipc.sockets import Socket

codec = Codec(m.CLIENT_MESSAGES)


async def _generate_against_script(window: int, max_tokens: int, chunks: int,
                                   stop: tuple[str, ...] = ()) -> tuple[list[int], list[int]]:
    """Run one generation against a daemon that sends `chunks` chunks, a credit each; return
    the token ids the client saw and the credit grants the daemon received."""
    grants: list[int] = []
    with trio.fail_after(20), Socket(zmq.ROUTER) as daemon:
        address = daemon.bind("tcp://127.0.0.1:0")

        state = {"credits": 0, "who": b"", "rid": ""}
        credit_came = trio.Event()

        async def receive() -> None:
            while True:
                identity, frame = await daemon.recv_multipart()
                msg = codec.decode(frame)
                if isinstance(msg, m.Describe):
                    daemon.route_nowait([identity, codec.encode(
                        m.ServerInfo(m.PROTOCOL_VERSION, "fake", 0, 1 << 20))])
                elif isinstance(msg, m.Generate):
                    state.update(who=identity, rid=msg.request_id, credits=msg.credits)
                    daemon.route_nowait([identity, codec.encode(m.Accepted(msg.request_id, 1))])
                    credit_came.set()
                elif isinstance(msg, m.Credit):
                    grants.append(msg.chunks)
                    state["credits"] += msg.chunks
                    credit_came.set()

        async def send_chunks() -> None:
            """A chunk per step, a few milliseconds apart, while there is credit."""
            nonlocal credit_came
            sent = 0
            while sent < chunks:
                if not state["credits"]:
                    await credit_came.wait()
                    credit_came = trio.Event()
                    continue
                state["credits"] -= 1
                sent += 1
                chunk = m.Chunk(state["rid"], "x", (sent - 1,))
                if sent < chunks:
                    daemon.route_nowait([state["who"], codec.encode(chunk)])
                    await trio.sleep(0.003)
                else:  # the last one in one frame with the Finished, as the daemon sends it
                    daemon.route_nowait([state["who"], codec.encode_batch(
                        [chunk, m.Finished(state["rid"], m.FinishReason.LENGTH)])])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            nursery.start_soon(send_chunks)
            async with AsyncClient(address, credit_window=window) as client:
                generation = await client.generate("hi", max_tokens=max_tokens, stop=stop)
                result = await generation.collect()
            nursery.cancel_scope.cancel()
    return result.token_ids, grants


async def test_credits_keep_a_window_open_for_a_long_generation() -> None:
    ids, grants = await _generate_against_script(window=8, max_tokens=40, chunks=40)
    assert ids == list(range(40))
    # topped up each time half the window was spent, and not past what 40 chunks need
    assert grants and all(g == 4 for g in grants)
    assert 8 + sum(grants) >= 40


@pytest.mark.parametrize("stop", [(), ("END",)])
async def test_no_credit_is_sent_that_the_request_could_never_spend(stop) -> None:
    """A window that covers every chunk the request can bring (a token each, and one of text
    held back for a stop string) needs no credit at all."""
    max_tokens = 8 if stop else 9
    ids, grants = await _generate_against_script(window=9, max_tokens=max_tokens,
                                                 chunks=max_tokens, stop=stop)
    assert ids == list(range(max_tokens))
    assert grants == []


@pytest.mark.parametrize("window", [2, 5])
async def test_a_daemon_sending_more_chunks_than_expected_still_gets_credit(window) -> None:
    """Were the count of chunks a request can bring ever too low, the client still grants
    when the last credit is spent, so the daemon never waits for ever."""
    ids, grants = await _generate_against_script(window=window, max_tokens=2, chunks=11)
    assert ids == list(range(11))
    assert grants
