"""Clients that send and never read, for the flood tests.

A `Flooder` is a raw ZeroMQ DEALER on its own thread (the daemon under test is a separate
process; a thread keeps the flood going whatever the test's trio loop is doing). It keeps
the smallest receive queue it can, so what the daemon sends it piles up on the daemon's side.
"""

from __future__ import annotations

import os
import threading
import time

import zmq


class Flooder:
    def __init__(self, address: str, first: list[bytes], then: bytes):
        """Send the frames of `first` once, then `then` over and over until stopped."""
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTING_ID, os.urandom(8))
        self.socket.setsockopt(zmq.RCVHWM, 1)
        self.socket.setsockopt(zmq.RCVBUF, 4096)
        self.socket.connect(address)
        self.identity = self.socket.getsockopt(zmq.ROUTING_ID)
        self.first = list(first)
        self.then = then
        self.sent = 0
        self._blocked_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="flooder")

    def __enter__(self) -> Flooder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.socket.close(linger=0)

    def blocked_for(self) -> float:
        """Seconds its sends have been refused in a row (the daemon stopped reading)."""
        since = self._blocked_since
        return 0.0 if since is None else time.monotonic() - since

    def _run(self) -> None:
        pending = list(self.first)
        while not self._stop.is_set():
            for _ in range(200):  # in bursts, leaving the two cores some air
                frame = pending[0] if pending else self.then
                try:
                    self.socket.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    if self._blocked_since is None:
                        self._blocked_since = time.monotonic()
                    break
                self._blocked_since = None
                self.sent += 1
                if pending:
                    pending.pop(0)
            time.sleep(0.001)
