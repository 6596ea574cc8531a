"""The client library against a daemon that forgot its connection (it did not read), and
against a backlog of frames that queued up while the client was busy.

The daemon ends the connection's requests without a word it could deliver, then answers a
later frame with `Rejected(overloaded)`, field `connection`, no request id. The library
ends every pending generation with an error saying so, and the connection serves again.
A scripted ROUTER in the test stands in for the daemon (a named fake: the real daemon's
side is covered by tests/faults/test_flood.py).
"""

from __future__ import annotations

import time

import trio
import zmq

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.codec import Codec
from sluice.ipc.sockets import Socket

codec = Codec(m.CLIENT_MESSAGES)


async def test_pending_generations_end_when_the_daemon_forgot_the_connection() -> None:
    with trio.fail_after(20), Socket(zmq.ROUTER) as daemon:
        address = daemon.bind("tcp://127.0.0.1:0")

        async def answer(identity: bytes, msg: object) -> None:
            await daemon.send_multipart([identity, codec.encode(msg)])

        async def fake_daemon() -> None:
            while True:
                identity, frame = await daemon.recv_multipart()
                msg = codec.decode(frame)
                if isinstance(msg, m.Describe):
                    await answer(identity, m.ServerInfo(m.PROTOCOL_VERSION, "fake", 0, 1 << 20))
                elif isinstance(msg, m.Generate) and msg.prompt == "forgotten":
                    await answer(identity, m.Accepted(msg.request_id, 1))
                    await answer(identity, m.Rejected("", m.RejectCode.OVERLOADED,
                                                      "dropped: it did not read", "connection"))
                elif isinstance(msg, m.Generate):
                    await answer(identity, m.Accepted(msg.request_id, 1))
                    await answer(identity, m.Finished(msg.request_id, m.FinishReason.LENGTH))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fake_daemon)
            async with AsyncClient(address) as client:
                lost = await client.generate("forgotten")
                result = await lost.collect()
                assert result.finish_reason == "error"
                assert result.error == "dropped: it did not read"
                again = await client.generate("served again")
                assert (await again.collect()).finish_reason == "length"
            nursery.cancel_scope.cancel()


async def test_a_backlog_of_frames_is_routed_whole() -> None:
    """Frames that queued up while the client's event loop was busy are all routed, however
    many there are: the receive loop takes them in runs, and none falls between two runs."""
    count = 300  # several runs' worth
    with trio.fail_after(20), Socket(zmq.ROUTER) as daemon:
        address = daemon.bind("tcp://127.0.0.1:0")

        async def fake_daemon() -> None:
            while True:
                identity, frame = await daemon.recv_multipart()
                msg = codec.decode(frame)
                if isinstance(msg, m.Describe):
                    daemon.route_nowait([identity, codec.encode(
                        m.ServerInfo(m.PROTOCOL_VERSION, "fake", 0, 1 << 20))])
                elif isinstance(msg, m.Generate):
                    daemon.route_nowait([identity, codec.encode(m.Accepted(msg.request_id, 1))])
                    for i in range(count):  # one frame per token, sent without yielding
                        daemon.route_nowait([identity, codec.encode(
                            m.Chunk(msg.request_id, "x", (i,)))])
                    daemon.route_nowait([identity, codec.encode(
                        m.Finished(msg.request_id, m.FinishReason.LENGTH))])
                    time.sleep(0.3)  # hold the event loop: the client's socket queues them all

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fake_daemon)
            async with AsyncClient(address) as client:
                generation = await client.generate("many frames", max_tokens=count)
                result = await generation.collect()
                assert result.token_ids == list(range(count))
                assert result.finish_reason == "length"
            nursery.cancel_scope.cancel()
