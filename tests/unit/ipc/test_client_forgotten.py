"""The client library against a daemon that forgot its connection (it did not read).

The daemon ends the connection's requests without a word it could deliver, then answers a
later frame with `Rejected(overloaded)`, field `connection`, no request id. The library
ends every pending generation with an error saying so, and the connection serves again.
A scripted ROUTER in the test stands in for the daemon (a named fake: the real daemon's
side is covered by tests/faults/test_flood.py).
"""

from __future__ import annotations

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
