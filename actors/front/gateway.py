"""The Gateway actor: the client-facing ROUTER socket, and the limits of the client edge.

It decodes client frames (a bad one gets `Rejected` naming the problem), answers `Describe`,
routes everything else to the connection's Stream (started on its first message, supervised as
transient), sends the streams' `Outbound` frames without waiting on any one peer, refuses new
`Generate`s while draining, and reports its backlog to the Scheduler. Its ZAP handler answers
every connection's handshake: past the inbound budget, refused; with a CURVE secret key (a CURVE
server), admitted only for the listed client keys. See
docs/architecture.md, "A token's path" and "The client edge"; the limits are in
docs/configuration.md, "[limits]".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import structlog
import trio
import zmq
from zmq.utils import z85

from sluice.actors.runtime import messages as am
from sluice.actors.runtime.base import RESOURCE_ERRNOS, Actor, Handler, Inbox, Outbox, Outboxes
from sluice.actors.front.limits import Limits, clip
from sluice.actors.front.listener import ListenerGuard
from sluice.actors.front.peers import PeerBook
from sluice.actors.runtime.reports import BacklogGauge, Endpoint, EndpointQuery
from sluice.actors.front.stream import Stream
from sluice.actors.runtime.supervisor import Supervisor
from sluice.ipc import messages as m
from sluice.ipc.codec import Codec, CodecError
from sluice.ipc.sockets import PeerFull, PeerGone, Socket

log = structlog.get_logger("sluice.gateway")

FRAMES_PER_TURN = 64  # client frames taken in one turn of the event loop, at most
ZAP_ANSWERS_PER_TURN = 256  # handshakes answered in one turn of the event loop, at most
KEEPALIVE_PROBES = 3  # unanswered keepalive probes before the kernel drops a connection
_FORGOTTEN = ("this connection was dropped because it did not read what it was sent; "
              "its requests ended")

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
        limits: Limits = Limits(),
        fd_share: float = 1.0,  # of the descriptors past the reserve: 0.5 beside the HTTP front
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 10.0,
        inbox: Inbox | None = None,
        curve_secret_key: str | None = None,
        tenant_keys: dict[str, str] | None = None,
        keyed_tenants: frozenset[str] = frozenset(),
        backlog_to: Outbox | None = None,
        usage: Outbox | None = None,
    ):
        super().__init__(inbox=inbox)
        self.usage = usage  # told the codes of the rejections sent here, for the metrics
        self.rejected: list[m.RejectCode] = []  # sent and not yet told
        self.backlog_to = backlog_to  # the Scheduler, told how far this actor is behind
        self.backlog = BacklogGauge(self.name)
        self.curve_secret_key = curve_secret_key  # Z85; None: no authentication
        self.tenant_keys = dict(tenant_keys or {})  # client public key (Z85) -> tenant
        # tenants that own keys (API keys, CURVE keys): never served on an unauthenticated socket
        self.keyed_tenants = keyed_tenants
        self.listen = listen
        self.codec = codec
        self.supervisor = supervisor
        self.make_stream = make_stream
        self.limits = limits
        self.connection_cap = limits.connection_cap(fd_share)
        self.heartbeat = (heartbeat_interval, heartbeat_timeout)
        self.info = replace(info, max_frame_bytes=limits.max_frame_bytes,
                            max_credits=limits.max_credits)
        self.address: str | None = None  # the bound address, kept across restarts
        self.draining = False
        self.streams: dict[bytes, Stream] = {}
        self.owners: dict[bytes, str] = {}  # with CURVE: connection -> the key of its Stream
        # connection -> the descriptor its stream's first frame came in on, for the listener,
        # which closes connections that hold no stream for long (`idle_connection_seconds`)
        self.descriptors: dict[bytes, int] = {}
        # kept across restarts, like the streams: the counters are the daemon's lifetime's
        self.peers = PeerBook(self.connection_cap)
        self.askers = Outboxes()  # who asked for the live connections (the control actor)

    def reset(self) -> None:
        # a context of its own: its I/O thread serves strangers' connections only, and the
        # ZAP endpoint it binds is this gateway's, whatever else runs in the process
        self.context = zmq.Context()
        try:
            self._open()
        except BaseException:
            self.context.destroy(linger=0)  # what it opened, closed; its I/O thread ended
            raise

    def _open(self) -> None:
        # every connection's handshake waits for this actor's ZAP answer, with or without
        # CURVE: a connection past the inbound budget is refused before any frame of it can
        # be queued (refused at its accept, it has often queued a full pipe already). A ROUTER,
        # not a REP: its answers never wait, so the requests that queued up are answered in
        # one turn of the loop (see `_authenticate`)
        self.zap = Socket(zmq.ROUTER, ctx=self.context)
        self.zap.bind(ZAP_ENDPOINT)
        self.socket = Socket(zmq.ROUTER, ctx=self.context)
        self._limit_peers(self.socket.zmq)
        self.socket.zmq.zap_domain = ZAP_DOMAIN
        if self.curve_secret_key is not None:
            self.socket.zmq.curve_server = True
            self.socket.zmq.curve_secretkey = self.curve_secret_key.encode()
        # past the cap of streams a few more connections are taken, each one descriptor, to be
        # told `Rejected(overloaded)`; past those the listener sheds them unanswered
        spare = self.limits.reserved_fds
        listener = ListenerGuard(
            self.socket, peers=self.peers, cap=self.connection_cap + max(1, spare // 8),
            inbound_connections=self.limits.inbound_connections(),
            brake_margin=max(1, spare // 4), fd_reserve=max(1, spare // 2),
            idle_seconds=self.limits.idle_connection_seconds)
        try:
            self.address = listener.bind(self.address or self.listen)
        except BaseException:
            listener.close()  # its monitor stopped: the context can end
            raise
        for descriptor in self.descriptors.values():  # streams that outlived a crash
            listener.held(descriptor)
        self.listener = listener

    def _limit_peers(self, router: zmq.Socket) -> None:
        """What one peer may make this socket hold; set before bind, so every pipe has it."""
        interval, timeout = self.heartbeat
        # a peer that does not read pins at most this many frames, then it is forgotten
        router.setsockopt(zmq.SNDHWM, self.limits.peer_send_hwm)
        # what a peer sends ahead of the gateway's reading waits in its own socket buffers
        router.setsockopt(zmq.RCVHWM, self.limits.peer_recv_hwm)
        # checked while a frame arrives: a larger one is never buffered, its peer is dropped
        router.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes)
        # a connection that never finishes its handshake is dropped after the silence timeout
        router.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(timeout * 1000)))
        # dead and half-open peers are found by the kernel's keepalive probes. Not by ZeroMQ's
        # own pings (ZMQ_HEARTBEAT_IVL): libzmq 4.3 aborts the process when a ping falls due on
        # a connection whose peer hung up while its inbound queue was full (a flood, then a
        # disconnect), so that option hands any client a way to kill the daemon
        router.setsockopt(zmq.TCP_KEEPALIVE, 1)
        router.setsockopt(zmq.TCP_KEEPALIVE_IDLE, max(1, round(timeout)))
        router.setsockopt(zmq.TCP_KEEPALIVE_INTVL, max(1, round(interval)))
        router.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)

    def _shown(self, identity: bytes) -> str:
        """A routing id as a log may show it: the client chose it, so it is clipped."""
        return clip(identity.hex(), self.limits)

    def teardown(self) -> None:
        self.listener.close()
        self.socket.close()
        self.zap.close()
        self.context.destroy(linger=0)  # never waits: any socket still open is closed

    def close(self) -> None:
        super().close()
        self.askers.close()
        for stream in self.streams.values():
            stream.close()

    def handlers(self) -> dict[type, Handler]:
        return {
            am.Outbound: self.on_outbound,
            am.StreamClosed: self.on_stream_closed,
            am.Drain: self.on_drain,
            am.EndDrain: self.on_end_drain,
            am.Ask: self.on_ask,
            am.Operate: self.on_operate,
        }

    def after_message(self) -> None:
        self.backlog.report(self.inbox.depth, self.backlog_to)

    async def background(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._authenticate)
        nursery.start_soon(self._receive_loop)
        nursery.start_soon(self.listener.run)
        nursery.start_soon(self.listener.sweep)

    async def _authenticate(self) -> None:
        """ZAP, at each connection's handshake: 400 past the inbound budget (no frame of it
        was queued); with CURVE, 200 with the key as user id for a listed key, else 400.

        The requests that queued up are answered in the same turn of the loop, up to a bound.
        A connection waiting for its answer holds libzmq's buffers (~50 KB) even once its
        peer has left. Answered one a turn, they fell behind a churn of strangers' connections
        and were then answered hundreds at once: meanwhile the C heap held up to 60 MB more,
        all for connections already gone."""
        while True:
            requests = [await self.zap.recv_multipart()]
            while len(requests) < ZAP_ANSWERS_PER_TURN:
                request = self.zap.recv_multipart_nowait()
                if request is None:
                    break
                requests.append(request)
            for request in requests:
                self._answer_zap(request)

    def _answer_zap(self, request: list[bytes]) -> None:
        # [libzmq's routing id, empty delimiter, version, request id, domain, address,
        # identity, mechanism, credentials...]
        envelope, request = request[:2], request[2:]
        version, request_id, mechanism = request[0], request[1], request[5]
        key = None
        if mechanism == b"CURVE" and len(request) > 6:
            key = z85.encode(request[6]).decode()
        if self.curve_secret_key is not None and key not in self.tenant_keys:
            log.info("client refused", mechanism=mechanism.decode(errors="replace"))
            reply = [version, request_id, b"400", b"unknown key", b"", b""]
        elif not self.listener.admit():
            reply = [version, request_id, b"400", b"over the inbound budget", b"", b""]
        else:  # with CURVE the key itself is the user id: a stream is bound to it, a
            # tenant found by it
            user = key.encode() if key is not None else b""
            reply = [version, request_id, b"200", b"OK", user, b""]
        try:
            self.zap.route_nowait([*envelope, *reply])
        except PeerGone:  # the connection asking is gone already: nobody to answer
            pass

    # -- to the client ----------------------------------------------------------------------

    async def on_outbound(self, msg: am.Outbound) -> None:
        if self.peers.is_forgotten(msg.connection):
            return  # its stream is ending its requests; nothing more goes to it
        try:
            # no turn of the loop per send: the actor loop yields every few messages, and a
            # turn per frame left a step's frames queued here behind whole steps
            self.socket.route_nowait([msg.connection, *msg.frames])
        except PeerGone as exc:
            self._lost(msg.connection, exc)

    async def _reply(self, identity: bytes, msg: Any, *, probe: bool = False) -> bool:
        """Answer one client frame; False (and the frame counted as dropped) if it cannot. A
        `Rejected` sent counts as a refused request, unless it is a probe."""
        try:
            await self.socket.send_multipart([identity, self.codec.encode(msg)])
        except PeerGone as exc:
            self.peers.dropped_frames += 1
            if not isinstance(exc, PeerFull):  # its later queued frames are dropped unread
                self.peers.gone(identity)
            self._lost(identity, exc)
            return False
        if isinstance(msg, m.Rejected) and not probe:
            self.rejected.append(msg.code)
        return True

    def _lost(self, identity: bytes, exc: PeerGone) -> None:
        """A send failed: a full peer is forgotten; either way its stream ends."""
        if isinstance(exc, PeerFull) and self.peers.forget(identity, trio.current_time()):
            log.warning("client forgotten", connection=self._shown(identity),
                        why="does not read")
        stream = self.streams.get(identity)
        if stream is not None:
            stream.inbox.put(am.ClientGone(identity))

    # -- from actors ------------------------------------------------------------------------

    async def on_stream_closed(self, msg: am.StreamClosed) -> None:
        stream = self.streams.pop(msg.connection, None)
        self.owners.pop(msg.connection, None)
        descriptor = self.descriptors.pop(msg.connection, None)
        if descriptor is not None:
            self.listener.released(descriptor)
        if stream is not None:
            # from now on the connection's frames open a fresh stream; the closed one refuses
            # what was routed to it before this answer, then ends
            stream.inbox.put(am.StreamClosed(msg.connection))

    async def on_drain(self, msg: am.Drain) -> None:
        self.draining = True

    async def on_end_drain(self, msg: am.EndDrain) -> None:
        self.draining = False

    async def on_ask(self, msg: am.Ask) -> None:
        if isinstance(msg.query, am.ListConnections):
            live = am.Connections(frozenset(self.streams),
                                 tuple(stream.inbox.address for stream in self.streams.values()),
                                 stats=self.peers.stats())
            self.askers.put(msg.reply_to, am.Reply(msg.token, live))
        elif isinstance(msg.query, EndpointQuery):
            self.askers.put(msg.reply_to, am.Reply(msg.token, Endpoint(self.address)))

    async def on_operate(self, msg: am.Operate) -> None:
        """The one operator command done here: the debug fault `vanish_stream` (the Control
        actor sends it only when the daemon allows fault injection)."""
        command = msg.command
        if isinstance(command, m.InjectFault) and command.kind == "vanish_stream":
            reply = self._vanish(command.target)
        else:
            reply = m.CommandReply("unknown", False, f"the gateway cannot do {command!r}")
        self.askers.put(msg.reply_to, am.Reply(msg.token, reply))

    def _vanish(self, target: str) -> m.CommandReply:
        """Debug fault: drop a connection's stream (the one named, else the newest) without a
        word to anyone."""
        if not self.streams:
            return m.CommandReply("fault", True, "no stream to drop")
        connection = next(reversed(self.streams))
        if target:
            named = [c for c in self.streams if c.hex() == target]
            if not named:
                return m.CommandReply("fault", False, f"no stream of connection {target[:64]}")
            connection = named[0]
        stream = self.streams.pop(connection)
        self.owners.pop(connection, None)
        self.supervisor.stop_child(stream)
        stream.inbox.close()
        return m.CommandReply("fault", True, f"dropped the stream of connection {connection.hex()}")

    # -- from the client --------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        while True:
            queued = self._queued()
            if queued is None:
                # nothing queued: the frames of peers that are gone have all been read
                self.listener.read_empty()
                self.peers.clear_gone()
                queued = await self.socket.recv_from(self.curve_secret_key is not None)
            else:  # a turn of the loop per run of frames, as when it waits; taken, so shielded
                await trio.lowlevel.cancel_shielded_checkpoint()
            await self._take_safely(*queued)
            # what queued up behind it is taken in the same turn of the event loop, up to a
            # bound: one frame per turn left client frames waiting behind whole steps (tens
            # of milliseconds under load, before the daemon even saw a request). ZeroMQ
            # queues fairly between peers, so no one peer's flood fills the turn.
            for _ in range(FRAMES_PER_TURN - 1):
                queued = self._queued()
                if queued is None:
                    break
                await self._take_safely(*queued)
            self._report_rejected()

    def _report_rejected(self) -> None:
        """Tell the Usage actor what was refused here, once per run of frames."""
        if self.rejected:
            rejected, self.rejected = tuple(self.rejected), []
            if self.usage is not None:
                self.usage.put(am.Ended((), rejected))

    def _queued(self) -> tuple[list[bytes], str | None, int] | None:
        """A client frame already on the socket, with its user id (None without CURVE) and
        the descriptor of its connection."""
        return self.socket.recv_from_nowait(self.curve_secret_key is not None)

    async def _take_safely(self, frames: list[bytes], key: str | None, descriptor: int) -> None:
        self.listener.heard(descriptor)
        try:
            await self._take(frames[0], frames[1:], key, descriptor)
        except zmq.ZMQError as exc:
            if exc.errno not in RESOURCE_ERRNOS:
                raise
            log.error("client frame dropped", connection=self._shown(frames[0]),
                      error=exc.strerror)
            self.peers.dropped_frames += 1

    async def _take(self, identity: bytes, parts: list[bytes], key: str | None,
                    descriptor: int = -1) -> None:
        """Handle one client message: answer it here, or route it to the connection's stream."""
        if self.peers.is_gone(identity):  # queued before it left: nobody to answer
            self.peers.dropped_frames += 1
            return
        if self.peers.is_forgotten(identity):
            await self._take_forgotten(identity)
            return
        if len(parts) != 1:
            await self._reply(identity, m.Rejected("", m.RejectCode.INVALID,
                                                  "expected exactly one frame", "frame"))
            return
        try:
            msg = self.codec.decode(parts[0])
        except CodecError as exc:
            await self._reply(identity, m.Rejected(exc.request_id, exc.code, exc.message,
                                                  exc.field))
            return
        if isinstance(msg, m.Describe):
            await self._reply(identity, self.info)
            return
        if isinstance(msg, m.Generate) and key is not None:
            msg = replace(msg, tenant=self.tenant_keys.get(key, msg.tenant))
        elif isinstance(msg, m.Generate) and msg.tenant in self.keyed_tenants:
            await self._reply(identity, m.Rejected(
                msg.request_id, m.RejectCode.UNAUTHORIZED,
                f"tenant {clip(msg.tenant, self.limits)!r} owns keys: its requests come "
                "with its key (HTTP API key or CURVE), never on this unauthenticated socket",
                "tenant"))
            return
        if isinstance(msg, m.Generate) and self.draining:
            self.peers.drain_refusals += 1
            await self._reply(identity, m.Rejected(msg.request_id, m.RejectCode.DRAINING,
                                                  "the daemon is draining"))
            return
        stream = self.streams.get(identity)
        if stream is not None and key is not None and self.owners.get(identity) != key:
            await self._take_over_refused(identity, stream, msg)
            return
        if stream is None:
            if isinstance(msg, m.Heartbeat):
                await self._reply(identity, m.Heartbeat())
                return
            stream = await self._open_stream(identity, msg, key)
            if stream is None:
                return
            if descriptor >= 0:
                self.descriptors[identity] = descriptor
                self.listener.held(descriptor)
        stream.inbox.put(msg)

    async def _take_forgotten(self, identity: bytes) -> None:
        """A forgotten peer's frame: dropped, or now and then answered to see if it reads."""
        if not self.peers.probe_due(identity, trio.current_time()):
            self.peers.dropped_frames += 1
            return
        if await self._reply(identity, m.Rejected("", m.RejectCode.OVERLOADED, _FORGOTTEN,
                                                  "connection"), probe=True):
            self.peers.remember(identity)  # it took a frame again: it reads, or reconnected
            log.info("client remembered", connection=self._shown(identity))

    async def _take_over_refused(self, identity: bytes, stream: Stream, msg: Any) -> None:
        """Another key uses a live stream's routing id. ZeroMQ refuses a duplicate id while
        its first holder is connected, so that client is gone: its stream ends, and nothing
        of it is handed to the newcomer, who may open its own once the old one closed."""
        log.warning("routing id reused by another key", connection=self._shown(identity))
        stream.inbox.put(am.ClientGone(identity))
        await self._reply(identity, m.Rejected(getattr(msg, "request_id", ""),
                                              m.RejectCode.UNAUTHORIZED,
                                              "this connection id belongs to another client",
                                              "connection"))

    async def _open_stream(self, identity: bytes, msg: Any, key: str | None) -> Stream | None:
        """The stream of a new connection, or None (the peer was refused: over the cap, or
        out of descriptors)."""
        if len(self.streams) >= self.connection_cap:
            why = f"the daemon serves at most {self.connection_cap} connections"
        else:
            try:
                stream = self.make_stream(identity)
            except zmq.ZMQError as exc:
                if exc.errno not in RESOURCE_ERRNOS:
                    raise
                why = "the daemon has no file descriptor left for another connection"
            else:
                self.streams[identity] = stream
                if key is not None:
                    self.owners[identity] = key
                await self.supervisor.start_child(stream, transient=True)
                return stream
        self.peers.refused_connections += 1
        log.debug("connection refused", connection=self._shown(identity), why=why)
        await self._reply(identity, m.Rejected(getattr(msg, "request_id", ""),
                                              m.RejectCode.OVERLOADED, why, "connections"))
        return None

    async def on_crash(self, exc: BaseException) -> None:
        # each stream fails its requests and reports StreamClosed, which the restarted
        # gateway handles like any other close
        for stream in self.streams.values():
            stream.inbox.put(am.FailAll(f"gateway failed: {type(exc).__name__}"))


ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks who may connect
ZAP_DOMAIN = b"sluice"  # set, so that libzmq asks for connections without CURVE too

