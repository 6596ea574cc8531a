"""The HTTP front's server: hypercorn's protocols on connections and an accept loop of the
front's own, so that no client holds more than it is allowed.

hypercorn's `serve` accepts for as long as the process has descriptors, speaks HTTP/2 to any
client that asks for it in cleartext (h2c), and waits on a write for as long as the client
takes. Here the live connections are counted and accepting pauses at a cap (derived from the
fd limit unless configured), idle connections closed first to make room; HTTP/2 is spoken
only when configured; and a write the client does not take within `send_timeout` costs it
its connection.

What does not belong here: routes, keys and the limits on requests (`actors.http.front`).
"""

from __future__ import annotations

import json
import resource
import socket
from collections.abc import Callable
from itertools import islice
from math import inf
from typing import Any

import h2.errors
import h2.exceptions
import h11
import priority
import structlog
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.protocol.h11 import H2CProtocolRequiredError, H2ProtocolAssumedError, H11Protocol
from hypercorn.trio.task_group import TaskGroup
from hypercorn.trio.worker_context import TrioSingleTask, WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import parse_socket_addr, repr_socket_addr, wrap_app

from sluice.actors.runtime.base import RESOURCE_ERRNOS

log = structlog.get_logger("sluice.http")

_MAX_RECV = 2**16
_NO_HTTP2 = json.dumps({"error": {
    "message": "this server speaks HTTP/1.1 (http.http2 = false)",
    "type": "invalid_request_error", "param": None,
    "code": "http_version_not_supported"}}).encode()


def connection_cap(reserved_fds: int) -> int:
    """Live HTTP connections the fd limit leaves room for: half of the descriptors
    `reserved_fds` leaves (the ZeroMQ front's connections need the others)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(1, (soft - reserved_fds) // 2)


class ServerConfig(Config):
    """hypercorn's settings, and what the connections here add to them."""

    send_timeout: float = 60.0  # seconds a write may wait for the client to take it
    http2: bool = False  # h2c (prior knowledge or Upgrade); off: HTTP/1.1 only

    def create_sockets(self):
        sockets = super().create_sockets()
        for listener in sockets.insecure_sockets:
            # accepted connections inherit it: what the kernel still holds of a connection
            # closed at a write's deadline is dropped after as long again
            listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                                int(self.send_timeout * 1000))
        return sockets


class Connections:
    """The live connections, against a cap. At the cap, with a client waiting to be accepted,
    idle connections are closed (idle longest first) down to the low-water mark; while none
    is idle, accepting waits until enough others have ended."""

    def __init__(self, cap: int):
        self.cap = cap
        self.low_water = cap - max(1, cap // 10)
        self.live: set[Connection] = set()
        self._idle: dict[Connection, None] = {}  # in the order they became idle
        self._closing: set[Connection] = set()  # closed to make room, not ended yet
        self._changed = trio.Event()

    def __len__(self) -> int:
        return len(self.live)

    def full(self) -> bool:
        return len(self.live) >= self.cap

    def add(self, connection: Connection) -> None:
        self.live.add(connection)
        self._idle[connection] = None  # no request yet

    def remove(self, connection: Connection) -> None:
        self.live.discard(connection)
        self._idle.pop(connection, None)
        self._closing.discard(connection)
        self._changed.set()

    def set_idle(self, connection: Connection, idle: bool) -> None:
        self._idle.pop(connection, None)
        if idle and connection in self.live and connection not in self._closing:
            self._idle[connection] = None
            self._changed.set()

    async def make_room(self) -> None:
        """Return once there is room for one more below the low-water mark."""
        while len(self.live) > self.low_water:
            excess = len(self.live) - len(self._closing) - self.low_water
            for connection in list(islice(self._idle, max(0, excess))):
                del self._idle[connection]
                self._closing.add(connection)
                connection.scope.cancel()
            self._changed = trio.Event()
            await self._changed.wait()


class _Http1(H11Protocol):
    """hypercorn's HTTP/1.1 without its switch to HTTP/2: an `Upgrade: h2c` is ignored (the
    request is answered in HTTP/1.1, as a server may), and the preface of HTTP/2 with prior
    knowledge (`PRI * HTTP/2.0`) gets 505 and the connection closed."""

    async def _check_protocol(self, event: h11.Request) -> None:
        return

    async def _create_stream(self, request: h11.Request) -> None:
        if request.http_version != b"2.0":
            await super()._create_stream(request)
            return
        await self._send_h11_event(h11.Response(status_code=505, headers=[
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(_NO_HTTP2)), (b"connection", b"close")]))
        await self._send_h11_event(h11.Data(data=_NO_HTTP2))
        await self._send_h11_event(h11.EndOfMessage())
        await self.send(Closed())


class _Http2(H2Protocol):
    """hypercorn's HTTP/2, where a stream's shut window holds its writer back (hypercorn's
    sender takes an empty chunk from a stream it may not send on as room in its buffer, so a
    response would be buffered whole), and a stream the app gave up on is reset, what it
    could not send dropped."""

    async def _send_data(self, stream_id: int) -> None:
        try:
            shut = self.connection.local_flow_control_window(stream_id) <= 0
        except h2.exceptions.ProtocolError:
            shut = False  # closed: hypercorn's own handling forgets the stream
        buffer = self.stream_buffers.get(stream_id)
        if shut and buffer is not None and buffer.buffer:
            self.priority.block(stream_id)  # a WINDOW_UPDATE unblocks it
            return
        await super()._send_data(stream_id)

    async def _close_stream(self, stream_id: int) -> None:
        await super()._close_stream(stream_id)
        buffer = self.stream_buffers.get(stream_id)
        if buffer is None or buffer.complete or self.closed:
            return
        # the response ended unsent (its client granted no window within the deadline)
        del self.stream_buffers[stream_id]
        await buffer.close()
        try:
            self.priority.remove_stream(stream_id)
            self.connection.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        except (h2.exceptions.ProtocolError, priority.MissingStreamError):
            return  # the client reset it
        await self._flush()


class _Http1Or2:
    """HTTP/1.1 that becomes `_Http2` when the client asks for h2c (with prior knowledge or
    an `Upgrade`), as hypercorn's `ProtocolWrapper` does with its own HTTP/2."""

    def __init__(self, *args: Any):
        self.args = args
        self.protocol: H11Protocol | _Http2 = H11Protocol(*args)

    async def initiate(self) -> None:
        await self.protocol.initiate()

    async def handle(self, event: Event) -> None:
        try:
            await self.protocol.handle(event)
        except H2ProtocolAssumedError as error:
            self.protocol = _Http2(*self.args)
            await self.protocol.initiate()
            if error.data:
                await self.protocol.handle(RawData(data=error.data))
        except H2CProtocolRequiredError as error:
            self.protocol = _Http2(*self.args)
            await self.protocol.initiate(error.headers, error.settings)
            if error.data:
                await self.protocol.handle(RawData(data=error.data))


class Connection:
    """One accepted connection: what hypercorn's `TCPServer` does, with a deadline on each
    write and a scope that closes the connection to make room for another."""

    def __init__(self, app: Any, config: ServerConfig, context: WorkerContext,
                 stream: trio.SocketStream, connections: Connections):
        self.app = app
        self.config = config
        self.context = context
        self.stream = stream
        self.connections = connections
        self.scope = trio.CancelScope()
        self.send_lock = trio.Lock()
        self.idle_task = TrioSingleTask()
        self.protocol: _Http1Or2 | _Http1

    async def run(self) -> None:
        try:
            with self.scope:
                sock = self.stream.socket
                client = parse_socket_addr(sock.family, sock.getpeername())
                server = parse_socket_addr(sock.family, sock.getsockname())
                async with TaskGroup() as task_group:
                    self.task_group = task_group
                    args = (self.app, self.config, self.context, task_group,
                            ConnectionState({}), False, client, server, self.protocol_send)
                    self.protocol = _Http1Or2(*args) if self.config.http2 else _Http1(*args)
                    await self.protocol.initiate()
                    await self.idle_task.restart(task_group, self._idle_timeout)
                    await self._read_data()
                    await self.idle_task.stop()  # the client is gone: its descriptor goes now
        except OSError:
            pass  # gone before or while it was served
        except Exception:  # a fault of one connection costs that connection only
            log.exception("http connection failed")
        finally:
            self.connections.remove(self)
            with trio.CancelScope(shield=True):
                await self._close()
            self._forget()

    def _forget(self) -> None:
        """Drop what this connection holds once it is closed. Its protocol holds it back (its
        `protocol_send`), and that cycle, with the connection's buffers and socket in it, was
        freed only by a full collection of the garbage collector, which the daemon runs once
        a minute: under a soak's churn of HTTP clients, hundreds of closed connections were
        waiting for it at any time."""
        self.__dict__.pop("protocol", None)
        self.__dict__.pop("task_group", None)

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, RawData):
            async with self.send_lock:
                sent = await self._send_in_time(event.data)
            if not sent:
                await self.protocol.handle(Closed())
        elif isinstance(event, Closed):
            # this may run in the app's task, which a response's end can cancel (the app
            # watches for the disconnect that ending the response is): the socket closes anyway
            with trio.CancelScope(shield=True):
                await self._close()
            await self.protocol.handle(Closed())
        elif isinstance(event, Updated):
            self.connections.set_idle(self, event.idle)
            if event.idle:
                await self.idle_task.restart(self.task_group, self._idle_timeout)
            else:
                await self.idle_task.stop()

    async def _send_in_time(self, data: bytes) -> bool:
        """Write `data`; False, the connection closed, when the connection is closing or the
        client took none of it within `send_timeout`. Shielded, as hypercorn's writes are (a
        write cut short would garble the response), but with that deadline."""
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self.config.send_timeout):
                try:
                    await self.stream.send_all(data)
                    return True
                except (trio.BrokenResourceError, trio.BusyResourceError,
                        trio.ClosedResourceError):
                    pass  # gone, or being closed (its `send_eof`)
            await trio.aclose_forcefully(self.stream)  # its reader ends too
        return False

    async def _read_data(self) -> None:
        while True:
            try:
                with trio.fail_after(self.config.read_timeout or inf):
                    data = await self.stream.receive_some(_MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                break
            await self.protocol.handle(RawData(bytes(data)))
            if data == b"":
                break
        await self.protocol.handle(Closed())

    async def _close(self) -> None:
        try:
            await self.stream.send_eof()
        except (trio.BrokenResourceError, trio.BusyResourceError, trio.ClosedResourceError):
            pass
        await self.stream.aclose()

    async def _idle_timeout(self) -> None:
        with trio.move_on_after(self.config.keep_alive_timeout):
            await self.context.terminated.wait()
        with trio.CancelScope(shield=True):
            await self.protocol.handle(Closed())
            await self.stream.aclose()


async def serve(app: Callable, config: ServerConfig, connections: Connections, *,
                task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the ASGI `app` on `config.bind`; `task_status` is given the addresses bound."""
    sockets = config.create_sockets()
    listeners = []
    for sock in sockets.insecure_sockets:
        sock.listen(config.backlog)
        listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
    binds = [f"http://{repr_socket_addr(sock.family, sock.getsockname())}"
             for sock in sockets.insecure_sockets]
    context = WorkerContext(None)
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(_accept, listener, connections, nursery,
                               lambda stream: Connection(wrapped, config, context, stream,
                                                         connections))
        task_status.started(binds)


async def _accept(listener: trio.SocketListener, connections: Connections,
                  nursery: trio.Nursery, connection: Callable[[trio.SocketStream], Connection]
                  ) -> None:
    short = False  # accept failing for want of descriptors
    async with listener:
        while True:
            if connections.full():
                await trio.lowlevel.wait_readable(listener.socket)  # someone waits for it
                await connections.make_room()
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in RESOURCE_ERRNOS:
                    raise
                if not short:
                    log.warning("http accept failed: no descriptor left",
                                connections=len(connections), cap=connections.cap)
                short = True
                await trio.sleep(0.1)  # what ends meanwhile gives its descriptor back
                continue
            short = False
            accepted = connection(stream)
            connections.add(accepted)
            nursery.start_soon(accepted.run)
