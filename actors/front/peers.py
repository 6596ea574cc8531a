"""The gateway's memory of the client peers it stopped talking to, and its edge counters.

A ROUTER cannot close one peer. So a peer that cannot take more (its send queue is full: it
does not read) is *forgotten*: its Stream ends its requests, and its later frames are dropped
unread, each counted, until an answer gets through again. At most once a second one of its
frames is answered with a `Rejected` that doubles as a probe: if the peer took it, it reads
again (or it reconnected under the same routing id, with a fresh empty queue) and is
remembered. The book holds at most `capacity` forgotten peers, the oldest forgotten first
out, so strangers cannot grow it.

A peer found gone (an answer to its frame failed: it disconnected) is remembered until the
gateway next finds its socket empty: libzmq still delivers the frames it sent before it left,
and those are dropped unread (counted) rather than decoded and answered into the void. That
memory too is bounded.

What does not belong here: sockets and actors (the gateway owns those).
"""

from __future__ import annotations

from sluice.ipc import messages as m

PROBE_INTERVAL = 1.0  # seconds between answers tried on one forgotten peer
GONE_CAPACITY = 65536  # peers remembered as gone, the oldest first out


class PeerBook:
    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        # forgotten peer -> the trio time from which its next frame may be answered
        self._forgotten: dict[bytes, float] = {}
        self._gone: dict[bytes, None] = {}  # in the order they were found gone
        self.dropped_frames = 0  # client frames discarded unanswered
        self.forgotten_peers = 0  # times a peer was forgotten
        self.refused_connections = 0  # new connections refused (cap, or out of descriptors)

    def __len__(self) -> int:
        return len(self._forgotten)

    def forget(self, identity: bytes, now: float) -> bool:
        """Stop talking to a peer; False when it was forgotten already."""
        if identity in self._forgotten:
            return False
        self._forgotten[identity] = now + PROBE_INTERVAL
        self.forgotten_peers += 1
        while len(self._forgotten) > self.capacity:
            del self._forgotten[next(iter(self._forgotten))]
        return True

    def is_forgotten(self, identity: bytes) -> bool:
        return identity in self._forgotten

    def probe_due(self, identity: bytes, now: float) -> bool:
        """May this forgotten peer's frame be answered now? (Then not again for a while.)"""
        if now < self._forgotten[identity]:
            return False
        self._forgotten[identity] = now + PROBE_INTERVAL
        return True

    def remember(self, identity: bytes) -> None:
        self._forgotten.pop(identity, None)

    def gone(self, identity: bytes) -> None:
        """A send to this peer found it disconnected."""
        self._gone[identity] = None
        if len(self._gone) > GONE_CAPACITY:
            del self._gone[next(iter(self._gone))]

    def is_gone(self, identity: bytes) -> bool:
        return identity in self._gone

    def clear_gone(self) -> None:
        """The socket was read empty: what comes from these ids now is a new connection's."""
        if self._gone:
            self._gone.clear()

    def stats(self) -> m.GatewayStats:
        return m.GatewayStats(self.dropped_frames, self.forgotten_peers,
                              self.refused_connections)
