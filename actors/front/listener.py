"""The client listener's connections: counted, and kept inside the descriptor and inbound budgets.

The gateway watches its ROUTER's monitor events to count live connections. Both budgets are
kept at each connection's handshake, which waits for the gateway's ZAP answer: a connection
past the connection cap, or past the inbound budget, is refused there before any frame of it is
queued, unless the connection idle longest (one that holds no stream and has sent nothing for a
grace period) is closed to make room. A refusal at the handshake is final for a ZeroMQ client;
a connection closed after it was accepted connects again within 100 ms, so shedding at the
accept (a reconnect storm of every peer past the cap, each costing libzmq's I/O thread ~50 KB
until the gateway's loop reaps it) is kept for when the descriptors run short. Only when
shedding falls behind near the fd limit is the listener unbound and bound again, as a last
resort. A connection that holds no stream and sends nothing for `idle_seconds` is closed (a
ZeroMQ client connects again by itself when it has something to send). See
docs/architecture.md, "The client edge".

What does not belong here: frames and peers by routing id (`gateway`, `peers`).
"""

from __future__ import annotations

import itertools
import os
import resource
import socket as pysocket
import time

import structlog
import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from sluice.actors.front.peers import PeerBook
from sluice.ipc.sockets import Socket

log = structlog.get_logger("sluice.listener")

REBIND_PAUSE = 1.0  # seconds between the listener's close and binding it again
# past the brake margin the descriptors in use are counted again after this many more
# accepts or this many seconds, whichever comes first (a count lists /proc/self/fd)
FD_RECOUNT_ACCEPTS = 32
FD_RECOUNT_SECONDS = 0.01
# accepts libzmq's I/O thread may make ahead of this task's reading: its monitor socket queues
# up to 1,000 messages, two an event, before the thread blocks on the next
MONITOR_LAG = 512
# not EVENT_ACCEPT_FAILED: a TCP listener out of descriptors retries its accept in a busy
# loop, and an event per try would hand this task (and the I/O thread it throttles) that loop
EVENTS = (zmq.EVENT_LISTENING | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
          | zmq.EVENT_CLOSED)
_monitors = itertools.count()
# seconds a connection must have held no stream before it may be closed to make room
MIN_IDLE_GRACE, MAX_IDLE_GRACE = 0.5, 5.0


class ListenerGuard:
    def __init__(self, router: Socket, *, peers: PeerBook, cap: int, inbound_connections: int,
                 brake_margin: int, fd_reserve: int, idle_seconds: float = 30.0):
        self.router = router
        self.peers = peers  # where connections shed are counted as refused
        self.cap = cap  # live connections, at most
        self.inbound_connections = inbound_connections  # pipes that may hold frames
        self.brake_margin = brake_margin
        self.fd_reserve = fd_reserve  # descriptors short of the limit at which it brakes
        self._fds_counted = (0, float("-inf"), 0)  # (live, when, descriptors in use) then
        self.live = 0  # accepted and not yet disconnected
        # accepted past the cap, to be refused at their handshakes (at most `live - cap`)
        self.over_cap = 0
        self.gone_unread = 0  # disconnected since the gateway last read its socket empty
        self.brakes = 0  # times the listener was unbound
        self.idle_closed = 0  # connections closed for holding no stream
        self.idle_seconds = idle_seconds
        # connections that hold no stream, idle longest first: descriptor -> the last time
        # (monotonic) it was accepted, sent a frame or ended its stream
        self._idle: dict[int, float] = {}
        self._held: set[int] = set()  # connections whose frames opened a stream
        self.address: str | None = None
        self._local: object = None  # what getsockname says for a connection of ours
        self._braked = False
        endpoint = f"inproc://sluice.listener-monitor.{next(_monitors)}"
        router.zmq.monitor(endpoint, EVENTS)
        self.events = Socket(zmq.PAIR, ctx=router.zmq.context)
        # the monitor's sends block libzmq's I/O thread when they are not read: the smallest
        # queue keeps its accepts close behind this task's reading
        self.events.zmq.setsockopt(zmq.RCVHWM, 1)
        self.events.connect(endpoint)

    def bind(self, address: str) -> str:
        self.address = self.router.bind(address)
        return self.address

    def close(self) -> None:
        """Before the ROUTER closes: a monitor event nobody reads would block libzmq's I/O
        thread (every connection of the process) for good, and so would stopping the monitor
        while that thread waits in a send, holding the monitor's lock: drain, stop, close."""
        while self.events.recv_multipart_nowait() is not None:
            pass
        self.router.zmq.disable_monitor()
        self.events.close()

    def read_empty(self) -> None:
        """The gateway found its socket empty: no gone peer's frames are queued any more."""
        self.gone_unread = 0

    async def run(self) -> None:
        while True:
            # events are read and counted with no checkpoint between, as `admit` reads them
            # too: one received here and counted after the receive's checkpoint could be a
            # connection's accept counted after its departure (read meanwhile by `admit`),
            # and that connection would stay counted live for good
            await self.events.wait_for(zmq.POLLIN)
            self.catch_up()
            if self._braked and self.live == 0 and self._local is None:
                await trio.sleep(REBIND_PAUSE)
                self._rebind()
            await trio.lowlevel.checkpoint()

    def catch_up(self) -> None:
        """Count every connection event already queued, without waiting."""
        frames = self.events.recv_multipart_nowait()
        while frames is not None:
            self._on_event_frames(frames)
            frames = self.events.recv_multipart_nowait()

    def _on_event_frames(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        self._on_event(event["event"], event["value"])

    def admit(self) -> bool:
        """May a connection in its handshake (no frame of it queued yet) go on? Within the
        inbound budget, yes; past it, only if the connection idle longest past its grace is
        closed to make room. A connection refused here is counted as refused."""
        self.catch_up()  # the accepts and departures the I/O thread has reported so far
        self.over_cap = min(self.over_cap, max(0, self.live - self.cap))
        if self.over_cap:  # one of the connections accepted past the cap
            self.over_cap -= 1
            return self._room_from_idle()
        if self.live + self.gone_unread <= self.inbound_connections:
            return True
        if self.gone_unread and not self.router.readable():
            # nothing queued: the gone peers' frames were all read. The gateway says so only
            # when it looks and finds the socket empty, and it looks only when a frame comes:
            # peers that left an idle daemon would keep every newcomer out for good
            self.gone_unread = 0
            if self.live <= self.inbound_connections:
                return True
        return self._room_from_idle()

    def _room_from_idle(self) -> bool:
        """Close the connection idle longest past its grace, to let one in its handshake go
        on; False (and that one counted as refused) if none is."""
        oldest = self._idle_past_grace()
        if oldest is None:
            self.peers.refused_connections += 1
            return False
        del self._idle[oldest]
        self._shed(oldest)
        return True

    def _on_event(self, event: int, value: int) -> None:
        if event == zmq.EVENT_ACCEPTED:
            self.live += 1
            # held already: the gateway read its first frame before this event was read
            if value not in self._held:
                self._idle.pop(value, None)
                self._idle[value] = time.monotonic()
            if self.live > self.cap:
                # while it waits for its handshake it holds a descriptor, and the I/O thread
                # may accept `MONITOR_LAG` more before this task reads their accepts
                if not self._fds_in_use_past(self.fd_reserve + MONITOR_LAG):
                    self.over_cap += 1  # refused at its handshake, for good
                    return
                self._make_room(value)  # descriptors are short: not a moment longer
                if (self.live > self.cap + self.brake_margin and not self._braked
                        and self._fds_in_use_past(self.fd_reserve)):
                    self._brake()
        elif event == zmq.EVENT_DISCONNECTED:
            self.live = max(0, self.live - 1)
            self.gone_unread += 1
            self._idle.pop(value, None)
            self._held.discard(value)
        elif event == zmq.EVENT_LISTENING:
            self._local = _local_name(value)
        elif event == zmq.EVENT_CLOSED:
            # the listener closed and its connections with it, without an event each
            self._local, self.live, self.over_cap = None, 0, 0
            self._idle.clear()
            self._held.clear()

    def held(self, fd: int) -> None:
        """The connection on `fd` opened a stream: it is a client's, not idle (its accept may
        not have been read yet: monitor events can lag behind its frames)."""
        self._idle.pop(fd, None)
        self._held.add(fd)

    def heard(self, fd: int) -> None:
        """A frame came in on `fd`: a connection without a stream is idle from now."""
        if fd in self._idle:
            del self._idle[fd]
            self._idle[fd] = time.monotonic()

    def released(self, fd: int) -> None:
        """The stream of the connection on `fd` closed: idle from now."""
        if fd in self._held:
            self._held.discard(fd)
            self._idle[fd] = time.monotonic()

    async def sweep(self) -> None:
        """Close connections that held no stream and sent nothing for `idle_seconds`: a
        stranger's idle connections cannot keep the cap full for good."""
        while True:
            await trio.sleep(max(0.05, self.idle_seconds / 4))
            deadline = time.monotonic() - self.idle_seconds
            for fd, since in list(self._idle.items()):
                if since > deadline:
                    break  # oldest first: the rest are younger
                del self._idle[fd]
                self._shed(fd, refused=False)
                self.idle_closed += 1

    def _make_room(self, new: int) -> None:
        """Over the connection cap: close the connection idle longest, if it has been idle
        for the grace period, else the new one. The grace keeps a client that just connected
        (its first frame not read yet) from being closed by a churn of newer connections."""
        oldest = self._idle_past_grace(new)
        if oldest is None:
            self._idle.pop(new, None)
            self._shed(new)
            return
        del self._idle[oldest]
        self._shed(oldest)  # a connection turned away all the same, the stranger's

    def _idle_past_grace(self, new: int = -1) -> int | None:
        """The connection idle longest, other than `new`, if idle for the grace period."""
        oldest = next((fd for fd in self._idle if fd != new), None)
        grace = min(max(self.idle_seconds / 10, MIN_IDLE_GRACE), MAX_IDLE_GRACE)
        if oldest is None or self._idle[oldest] > time.monotonic() - grace:
            return None
        return oldest

    def _fds_in_use_past(self, headroom: int) -> bool:
        """Whether the process's descriptors in use are within `headroom` of its limit,
        counted again only after `FD_RECOUNT_ACCEPTS` accepts or `FD_RECOUNT_SECONDS`."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return False
        live, when, in_use = self._fds_counted
        now = time.monotonic()
        if abs(self.live - live) >= FD_RECOUNT_ACCEPTS or now - when >= FD_RECOUNT_SECONDS:
            try:
                in_use = len(os.listdir("/proc/self/fd"))
            except OSError:  # no /proc to count in: the connection count alone decides
                in_use = soft
            self._fds_counted = (self.live, now, in_use)
        return in_use >= soft - headroom

    def _shed(self, fd: int, refused: bool = True) -> None:
        """Shut a connection down (libzmq then closes it): only if the descriptor still is a
        connection of this listener, since it may have been closed and reused since. A new
        connection shed is counted as refused."""
        try:
            conn = pysocket.socket(fileno=fd)
        except OSError:
            return
        try:
            if self._local is not None and _same_listener(conn.getsockname(), self._local):
                conn.shutdown(pysocket.SHUT_RDWR)
                if refused:
                    self.peers.refused_connections += 1
        except OSError:
            pass
        finally:
            conn.detach()

    def _brake(self) -> None:
        self._braked = True
        self.brakes += 1
        log.error("client listener unbound: connections came faster than they could be shed; "
                  "the connections it accepted are dropped with it", live=self.live,
                  cap=self.cap)
        self.router.zmq.unbind(self.address)

    def _rebind(self) -> None:
        try:
            self.router.bind(self.address)
        except zmq.ZMQError as exc:
            log.error("client listener not bound again yet", error=exc.strerror)
            return
        self._braked = False
        log.warning("client listener bound again", address=self.address)


def _local_name(fd: int) -> object:
    """The local address of the listening descriptor, as its connections will report it."""
    try:
        listener = pysocket.socket(fileno=fd)
    except OSError:
        return None
    try:
        return listener.getsockname()
    except OSError:
        return None
    finally:
        listener.detach()


def _same_listener(name: object, local: object) -> bool:
    if isinstance(name, tuple) and isinstance(local, tuple):  # tcp: the port is the listener's
        return name[1] == local[1]
    return name == local
