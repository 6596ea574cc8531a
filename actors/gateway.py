"""The Gateway actor: the client-facing ROUTER socket.

One task receives: each frame is decoded (a bad one gets `Rejected` naming the problem and
nothing else happens), `Describe` is answered here, everything else goes to the Stream actor
of that connection, started on its first message. The inbox carries frames to send
(`Outbound`) from every stream; a peer the ROUTER can no longer reach is reported to its
stream as `ClientGone`. While draining, new `Generate`s get `Rejected(draining)`.

With a CURVE secret key the socket is a CURVE server and a ZAP handler (in this actor)
admits only the client public keys listed per tenant; an unknown key never gets a frame
through. Each message then carries the tenant of its key (ZeroMQ's `User-Id` property) and
a `Generate` is attributed to that tenant whatever it names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import structlog
import trio
import zmq
from zmq.utils import z85

from sluice.actors.base import Actor, Handler, Inbox, Outboxes
from sluice.actors.stream import Stream
from sluice.actors.supervisor import Supervisor
from sluice.ipc import messages as m
from sluice.ipc.codec import Codec, CodecError
from sluice.ipc.sockets import PeerGone, Socket

log = structlog.get_logger("sluice.gateway")


class Gateway(Actor):
    name = "gateway"

    def __init__(
        self,
        listen: str,
        *,
        codec: Codec,
        supervisor: Supervisor,
        make_stream: Callable[[bytes], Stream],
        info: m.ServerInfo,
        inbox: Inbox | None = None,
        curve_secret_key: str | None = None,
        tenant_keys: dict[str, str] | None = None,
    ):
        super().__init__(inbox=inbox)
        self.curve_secret_key = curve_secret_key  # Z85; None: no authentication
        self.tenant_keys = dict(tenant_keys or {})  # client public key (Z85) -> tenant
        self.listen = listen
        self.codec = codec
        self.supervisor = supervisor
        self.make_stream = make_stream
        self.info = info
        self.address: str | None = None  # the bound address, kept across restarts
        self.draining = False
        self.streams: dict[bytes, Stream] = {}
        self.askers = Outboxes()  # who asked for the live connections (the control actor)

    def reset(self) -> None:
        self.zap: Socket | None = None
        if self.curve_secret_key is not None:
            self.zap = Socket(zmq.REP)
            self.zap.bind(ZAP_ENDPOINT)
        self.socket = Socket(zmq.ROUTER)
        if self.curve_secret_key is not None:
            self.socket.zmq.curve_server = True
            self.socket.zmq.curve_secretkey = self.curve_secret_key.encode()
        self.address = self.socket.bind(self.address or self.listen)

    def teardown(self) -> None:
        self.socket.close()
        if self.zap is not None:
            self.zap.close()

    def close(self) -> None:
        super().close()
        self.askers.close()
        for stream in self.streams.values():
            stream.close()

    def handlers(self) -> dict[type, Handler]:
        return {
            m.Outbound: self.on_outbound,
            m.StreamClosed: self.on_stream_closed,
            m.Drain: self.on_drain,
            m.Undrain: self.on_undrain,
            m.Ask: self.on_ask,
        }

    async def background(self, nursery: trio.Nursery) -> None:
        if self.zap is not None:
            nursery.start_soon(self._authenticate)
        nursery.start_soon(self._receive_loop)

    async def _authenticate(self) -> None:
        """ZAP: answer 200 with the tenant as user id for a listed CURVE key, else 400."""
        while True:
            request = await self.zap.recv_multipart()
            version, request_id, mechanism = request[0], request[1], request[5]
            tenant = None
            if mechanism == b"CURVE" and len(request) > 6:
                tenant = self.tenant_keys.get(z85.encode(request[6]).decode())
            if tenant is None:
                log.info("client refused", mechanism=mechanism.decode(errors="replace"))
                reply = [version, request_id, b"400", b"unknown key", b"", b""]
            else:
                reply = [version, request_id, b"200", b"OK", tenant.encode(), b""]
            await self.zap.send_multipart(reply)

    async def on_outbound(self, msg: m.Outbound) -> None:
        try:
            await self.socket.send_multipart([msg.connection, *msg.frames])
        except PeerGone:
            stream = self.streams.get(msg.connection)
            if stream is not None:
                stream.inbox.put(m.ClientGone(msg.connection))

    async def on_stream_closed(self, msg: m.StreamClosed) -> None:
        stream = self.streams.pop(msg.connection, None)
        if stream is not None:
            self.supervisor.stop_child(stream)
            stream.inbox.close()

    async def on_drain(self, msg: m.Drain) -> None:
        self.draining = True

    async def on_undrain(self, msg: m.Undrain) -> None:
        self.draining = False

    async def on_ask(self, msg: m.Ask) -> None:
        if isinstance(msg.query, m.ListConnections):
            live = m.Connections(frozenset(self.streams),
                                 tuple(stream.inbox.address for stream in self.streams.values()))
            self.askers.put(msg.reply_to, m.Reply(msg.token, live))

    def vanish(self, connection: bytes) -> bool:
        """Debug fault: drop a connection's stream without a word to anyone."""
        stream = self.streams.pop(connection, None)
        if stream is None:
            return False
        self.supervisor.stop_child(stream)
        stream.inbox.close()
        return True

    async def _receive_loop(self) -> None:
        while True:
            if self.curve_secret_key is None:
                frames, tenant = await self.socket.recv_multipart(), None
            else:
                frames, tenant = await self.socket.recv_with_user()
            identity = frames[0]
            if len(frames) != 2:
                await self._reply(identity, m.Rejected("", m.RejectCode.INVALID,
                                                      "expected exactly one frame", "frame"))
                continue
            try:
                msg = self.codec.decode(frames[1])
            except CodecError as exc:
                await self._reply(identity, m.Rejected(exc.request_id, exc.code, exc.message,
                                                      exc.field))
                continue
            if isinstance(msg, m.Describe):
                await self._reply(identity, self.info)
                continue
            if isinstance(msg, m.Generate) and tenant is not None:
                msg = replace(msg, tenant=tenant)
            if isinstance(msg, m.Generate) and self.draining:
                await self._reply(identity, m.Rejected(msg.request_id, m.RejectCode.DRAINING,
                                                      "the daemon is draining"))
                continue
            stream = self.streams.get(identity)
            if stream is None:
                if isinstance(msg, m.Heartbeat):
                    await self._reply(identity, m.Heartbeat())
                    continue
                stream = self.streams[identity] = self.make_stream(identity)
                await self.supervisor.start_child(stream)
            stream.inbox.put(msg)

    async def _reply(self, identity: bytes, msg: Any) -> None:
        try:
            await self.socket.send_multipart([identity, self.codec.encode(msg)])
        except PeerGone:
            pass

    async def on_crash(self, exc: BaseException) -> None:
        # each stream fails its requests and reports StreamClosed, which the restarted
        # gateway handles like any other close
        for stream in self.streams.values():
            stream.inbox.put(m.FailAll(f"gateway failed: {type(exc).__name__}"))


ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks who may connect

