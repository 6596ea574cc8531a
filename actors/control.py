"""The Control actor: the operator-facing ROUTER socket (status today; drain and more later).

Requests are decoded with the control codec and answered one at a time; status comes from
the Scheduler as a `Snapshot`. Bad frames get `Rejected` naming the problem.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace

import trio
import zmq

from sluice.actors.base import Actor, Handler, Inbox
from sluice.ipc import messages as m
from sluice.ipc.codec import Codec, CodecError
from sluice.ipc.sockets import PeerGone, Socket


class Control(Actor):
    name = "control"

    def __init__(self, address: str, *, scheduler: Inbox, connections: Callable[[], int] | None = None):
        super().__init__()
        self.listen = address
        self.address: str | None = None
        self.scheduler = scheduler
        self.connections = connections  # () -> int, live client connections
        self.codec = Codec(m.CONTROL_REQUESTS)

    def reset(self) -> None:
        self.socket = Socket(zmq.ROUTER)
        target = self.address or self.listen
        if target.startswith("ipc://"):
            path = target[len("ipc://"):]
            if os.path.exists(path):
                os.unlink(path)  # a stale socket of an earlier run
        self.address = self.socket.bind(target)
        if target.startswith("ipc://"):
            os.chmod(target[len("ipc://"):], 0o600)

    def teardown(self) -> None:
        self.socket.close()

    def handlers(self) -> dict[type, Handler]:
        return {}

    async def background(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._serve)

    async def status(self, query: m.StatusQuery) -> m.StatusReport:
        reply = Inbox("control-reply")
        self.scheduler.put(m.Ask(query, reply))
        with trio.fail_after(10):
            snapshot = await reply.get()
        report = snapshot.report
        if self.connections is not None:
            report = replace(report, connections=self.connections())
        return report

    async def _serve(self) -> None:
        while True:
            identity, *rest = await self.socket.recv_multipart()
            try:
                if len(rest) != 1:
                    raise CodecError("expected exactly one frame", field="frame")
                query = self.codec.decode(rest[0])
                answer = await self.status(query)
            except CodecError as exc:
                answer = m.Rejected(exc.request_id, exc.code, exc.message, exc.field)
            try:
                await self.socket.send_multipart([identity, self.codec.encode(answer)])
            except PeerGone:
                pass

