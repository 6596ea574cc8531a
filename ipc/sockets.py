"""A trio adapter for ZeroMQ sockets.

Each operation tries without blocking, then trusts `EVENTS` rather than the edge-triggered FD
before it sleeps; tasks waiting on one socket share one waiter. One task receives, any number
send. A ROUTER is `ROUTER_MANDATORY` and its sends never wait: `PeerGone` and `PeerFull` name the
one peer at fault. The `_nowait` forms take or send without a checkpoint. Cancellation never
loses a message. See docs/architecture.md, "ZeroMQ sockets on trio".
"""

from __future__ import annotations

import errno

import trio
import zmq


class PeerGone(Exception):
    """A ROUTER could not route to this identity: the peer disconnected."""

    def __init__(self, identity: bytes, why: str = "is gone"):
        super().__init__(f"peer {identity.hex()} {why}")
        self.identity = identity


class PeerFull(PeerGone):
    """A ROUTER peer's send queue is full (it does not read): to a sender, as good as gone.

    A subclass of `PeerGone` so that a caller that only knows "gone" drops such a peer too."""

    def __init__(self, identity: bytes):
        super().__init__(identity, "cannot take more")


_context: zmq.Context | None = None
# plain ints: `&` between pyzmq's flag enums goes through enum machinery, on every wait
EVENTS = int(zmq.EVENTS)
POLLIN = int(zmq.POLLIN)
MAX_SOCKETS = 65536


def context() -> zmq.Context:
    """The process's one ZeroMQ context (inproc:// endpoints only meet inside one)."""
    global _context
    if _context is None or _context.closed:
        _context = zmq.Context()
        # every actor inbox is a socket, and every client connection has a Stream actor:
        # the default of 1023 sockets would cap a daemon at a few hundred connections
        _context.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
    return _context


class Socket:
    """A ZeroMQ socket driven from trio without blocking the event loop."""

    def __init__(self, socket_type: int, *, ctx: zmq.Context | None = None):
        self.zmq = (ctx or context()).socket(socket_type)
        self.zmq.setsockopt(zmq.LINGER, 0)
        self._router = socket_type == zmq.ROUTER
        if self._router:
            self.zmq.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # never let a new connection take over a routing id that is in use: without
            # CURVE, anyone could choose a live client's id and receive its replies
            self.zmq.setsockopt(zmq.ROUTER_HANDOVER, 0)
        self._fd = self.zmq.getsockopt(zmq.FD)
        self._waiter_done: trio.Event | None = None
        self._waiter_scope: trio.CancelScope | None = None
        self._wanting: dict[int, int] = {}  # mask -> tasks in `wait_for` waiting for it
        self._closed = False

    # -- setup ----------------------------------------------------------------------------

    def bind(self, address: str) -> str:
        """Bind and return the address peers should use (tcp port 0 becomes a real port)."""
        self.zmq.bind(address)
        return self.zmq.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect(self, address: str) -> None:
        self.zmq.connect(address)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                trio.lowlevel.notify_closing(self._fd)
            except RuntimeError:  # closed outside trio: nobody can be waiting
                pass
            self.zmq.close(linger=0)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Socket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- I/O --------------------------------------------------------------------------------

    async def recv_multipart(self) -> list[bytes]:
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                frames = self.zmq.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                await self.wait_for(zmq.POLLIN)
                continue
            self._wake_waiter()
            await trio.lowlevel.cancel_shielded_checkpoint()  # taken: it must be returned
            return frames

    def recv_multipart_nowait(self) -> list[bytes] | None:
        """A message that is already here, or None: no wait and no checkpoint, for a reader
        that takes what queued up behind the message it awaited."""
        try:
            frames = self.zmq.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        self._wake_waiter()
        return frames

    async def recv(self) -> bytes:
        return (await self.recv_multipart())[-1]

    async def recv_from(self, user: bool = False) -> tuple[list[bytes], str | None, int]:
        """A message, the user id ZAP attached to it (asked only with `user`: None without)
        and the descriptor of the connection it came in on (-1 where there is none)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                parts = self.zmq.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                await self.wait_for(zmq.POLLIN)
                continue
            self._wake_waiter()
            await trio.lowlevel.cancel_shielded_checkpoint()
            return _source(parts, user)

    def recv_from_nowait(self, user: bool = False) -> tuple[list[bytes], str | None, int] | None:
        """`recv_from` for a message that is already here, or None."""
        try:
            parts = self.zmq.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        self._wake_waiter()
        return _source(parts, user)

    async def send_multipart(self, frames: list[bytes]) -> None:
        """Send one message; on a ROUTER `frames[0]` is the peer, and a full peer raises
        `PeerFull` at once (never waits), a vanished one `PeerGone`."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            try:
                self.zmq.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                if self._router:
                    raise PeerFull(frames[0]) from None
                await self.wait_for(zmq.POLLOUT)
                await trio.lowlevel.checkpoint()  # every retry yields, whatever EVENTS says
                continue
            except zmq.ZMQError as exc:
                if exc.errno == errno.EHOSTUNREACH:
                    raise PeerGone(frames[0]) from None
                raise
            self._wake_waiter()
            await trio.lowlevel.cancel_shielded_checkpoint()  # sent: say so, whatever the timeout
            return

    def route_nowait(self, frames: list[bytes]) -> None:
        """`send_multipart` on a ROUTER, whose send never waits, without its checkpoints:
        for a sender that yields on its own schedule (an actor takes several messages per
        turn of the loop), so that each send does not cost a turn."""
        if not self._router:
            raise TypeError("route_nowait is for ROUTER sockets, whose sends never wait")
        try:
            self.zmq.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            raise PeerFull(frames[0]) from None
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                raise PeerGone(frames[0]) from None
            raise
        self._wake_waiter()

    def send_nowait(self, frame: bytes) -> bool:
        """Send one frame if there is room now (True), without a checkpoint; False: nothing
        was sent, and `send` waits for room. Not for a ROUTER (see `route_nowait`)."""
        if self._router:
            raise TypeError("send_nowait is not for ROUTER sockets: use route_nowait")
        try:
            self.zmq.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        self._wake_waiter()
        return True

    async def send(self, frame: bytes) -> None:
        await self.send_multipart([frame])

    async def wait_for(self, mask: int) -> None:
        """Sleep until `EVENTS` has `mask` (zmq.POLLIN or POLLOUT) set."""
        # Reading EVENTS also re-arms the edge-triggered FD, so check it before every sleep.
        mask = int(mask)
        wanting = self._wanting
        wanting[mask] = wanting.get(mask, 0) + 1
        try:
            while self._closed or not self.zmq.get(EVENTS) & mask:
                if self._closed:
                    raise trio.ClosedResourceError("socket closed")
                if self._waiter_done is not None:
                    await self._waiter_done.wait()
                    continue
                done = self._waiter_done = trio.Event()
                try:
                    with trio.CancelScope() as scope:
                        self._waiter_scope = scope
                        await trio.lowlevel.wait_readable(self._fd)
                finally:
                    self._waiter_scope = None
                    self._waiter_done = None
                    done.set()
        finally:
            wanting[mask] -= 1
            if not wanting[mask]:
                del wanting[mask]

    def readable(self) -> bool:
        """Whether a message is queued to receive, without taking it. Reading `EVENTS` may
        consume the edge a task sleeps on: that task is woken when a message is there."""
        if self._closed or not self.zmq.get(EVENTS) & POLLIN:
            return False
        self._wake_waiter()
        return True

    def _wake_waiter(self) -> None:
        """After an operation: wake the task sleeping on the FD if `EVENTS` now shows what a
        waiting task waits for (the operation may have consumed that edge). Otherwise the FD
        signals the next change, and the sleeper is woken by it."""
        scope = self._waiter_scope
        if scope is None or scope.cancel_called:
            return
        wanted = 0
        for mask in self._wanting:
            wanted |= mask
        if self.zmq.get(EVENTS) & wanted:
            scope.cancel()


def _source(parts: list[zmq.Frame], user: bool) -> tuple[list[bytes], str | None, int]:
    last = parts[-1]
    return [p.bytes for p in parts], last.get("User-Id") if user else None, last.get(zmq.SRCFD)
