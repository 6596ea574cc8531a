"""The gateway's memory of the client peers it stopped talking to, and its edge counters.

A peer that cannot take more is *forgotten* (its requests end, its frames are dropped and
counted, a probe answer goes out once a second), and a peer found gone is remembered until the
socket is next empty; both memories are bounded. See docs/architecture.md, "The client edge".

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
        self.drain_refusals = 0  # requests refused while the daemon drained

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
                              self.refused_connections, self.drain_refusals)
