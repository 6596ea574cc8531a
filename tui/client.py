"""The console's connection to the daemon: a `zmq.asyncio` DEALER on the control socket.

It keeps a snapshot subscription alive (renewed every second, lasting a few), hands each
`ControlSnapshot` to a callback, and matches operator commands to their `CommandReply`.
"Connected" means a snapshot arrived recently; when the daemon goes away ZeroMQ reconnects
by itself, and the renewals bring the snapshots back once it is up again. Imports only
`sluice.ipc`: Textual runs on asyncio, the daemon on trio; they share only messages.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from sluice.ipc import messages as m
from sluice.ipc.codec import Codec, CodecError

RENEW_EVERY = 1.0  # seconds between Subscribe renewals
SUBSCRIPTION_TTL = 3.0  # seconds a subscription lasts without renewal
STALE_AFTER = 1.5  # seconds without a snapshot before the console shows "disconnected"


class ControlClient:
    def __init__(self, address: str, on_snapshot: Callable[[m.ControlSnapshot], None],
                 on_connection: Callable[[bool], None] = lambda up: None):
        self.address = address
        self.on_snapshot = on_snapshot
        self.on_connection = on_connection
        self.codec = Codec(m.CONTROL_REPLIES)
        self.connected = False
        self.last_snapshot = 0.0  # time.monotonic() of the latest snapshot
        self._ctx = zmq.asyncio.Context()
        self._socket: zmq.asyncio.Socket | None = None
        self._reply: asyncio.Future | None = None
        self._command_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, os.urandom(8))
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.SNDHWM, 16)  # renewals while the daemon is down need not pile up
        sock.connect(self.address)
        self._socket = sock
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._renew())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if self._socket is not None:
            self._socket.close(linger=0)
        self._ctx.destroy(linger=0)

    async def command(self, command: object, timeout: float = 15.0) -> m.CommandReply:
        """Send one operator command; raise TimeoutError if the daemon does not answer."""
        async with self._command_lock:
            loop = asyncio.get_running_loop()
            self._reply = loop.create_future()
            try:
                await self._socket.send(self.codec.encode(command), flags=zmq.NOBLOCK)
                return await asyncio.wait_for(self._reply, timeout)
            except zmq.Again:
                raise TimeoutError("the daemon is not reachable") from None
            finally:
                self._reply = None

    async def _renew(self) -> None:
        subscribe = self.codec.encode(m.Subscribe(ttl=SUBSCRIPTION_TTL))
        while True:
            try:
                await self._socket.send(subscribe, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # disconnected: the queue is full; the next renewal tries again
            await asyncio.sleep(RENEW_EVERY)
            stale = time.monotonic() - self.last_snapshot > STALE_AFTER
            if stale and self.connected:
                self._set_connected(False)

    async def _receive(self) -> None:
        while True:
            frame = await self._socket.recv()
            try:
                msg = self.codec.decode(frame)
            except CodecError:
                continue
            if isinstance(msg, m.ControlSnapshot):
                self.last_snapshot = time.monotonic()
                if not self.connected:
                    self._set_connected(True)
                self.on_snapshot(msg)
            elif self._reply is not None and not self._reply.done():
                if isinstance(msg, m.Rejected):
                    msg = m.CommandReply("rejected", False, msg.message)
                self._reply.set_result(msg)

    def _set_connected(self, up: bool) -> None:
        self.connected = up
        self.on_connection(up)
