"""A client at the level of frames, for tests that need what the library will not send.

`RawPeer` is a trio DEALER with a routing id the test chooses; it sends single messages or
raw frames and hands back every message the daemon sent, batches unpacked, heartbeats left out.
"""

from __future__ import annotations

import os
from typing import Any

import trio
import zmq

from sluice.ipc import messages as m
from sluice.ipc.codec import Codec
from sluice.ipc.sockets import Socket

client_codec = Codec(m.CLIENT_MESSAGES)
server_codec = Codec(m.SERVER_MESSAGES)


class RawPeer:
    def __init__(self, address: str, identity: bytes | None = None, *,
                 curve: tuple[bytes, bytes, bytes] | None = None):
        """`curve`: (server public key, this client's public key, its secret key)."""
        self.identity = identity or os.urandom(8)
        self.socket = Socket(zmq.DEALER)
        self.socket.zmq.setsockopt(zmq.ROUTING_ID, self.identity)
        if curve is not None:
            server, public, secret = curve
            self.socket.zmq.curve_serverkey = server
            self.socket.zmq.curve_publickey = public
            self.socket.zmq.curve_secretkey = secret
        self.socket.connect(address)
        self._queue: list[Any] = []  # unpacked from a batch, not yet handed out

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.socket.close()

    async def send(self, msg: Any) -> None:
        await self.socket.send(client_codec.encode(msg))

    async def receive(self) -> Any:
        """The next message that is not a heartbeat."""
        while not self._queue:
            frame = await self.socket.recv()
            self._queue.extend(msg for msg in server_codec.decode_batch(frame)
                               if not isinstance(msg, m.Heartbeat))
        return self._queue.pop(0)

    async def receive_for(self, seconds: float) -> list[Any]:
        """Every message that arrives within `seconds`."""
        got = []
        with trio.move_on_after(seconds):
            while True:
                got.append(await self.receive())
        return got

    async def until_finished(self, request_id: str) -> list[Any]:
        """Messages up to and including the request's `Finished` or `Rejected`."""
        got = []
        while True:
            msg = await self.receive()
            got.append(msg)
            if isinstance(msg, (m.Finished, m.Rejected)) and msg.request_id == request_id:
                return got

