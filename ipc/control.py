"""A minimal client of the control socket: the daemon's status and operator commands.

Used by `sluice status|drain|resume|...` and by tests; the console speaks the same messages
through `zmq.asyncio`.
"""

from __future__ import annotations

import os

import trio
import zmq

from sluice.ipc import messages as m
from sluice.ipc.codec import Codec
from sluice.ipc.errors import DaemonGone, error_for
from sluice.ipc.sockets import Socket

_codec = Codec((m.StatusReport, m.Rejected))


async def fetch_status(address: str, *, check_invariants: bool = False,
                       timeout: float = 10.0) -> m.StatusReport:
    with Socket(zmq.DEALER) as sock:
        sock.zmq.setsockopt(zmq.ROUTING_ID, os.urandom(8))
        sock.connect(address)
        await sock.send(_codec.encode(m.StatusQuery(check_invariants)))
        with trio.move_on_after(timeout):
            return _answer(await sock.recv())
    raise DaemonGone(f"no status from {address} within {timeout}s")


def fetch_status_sync(address: str, *, check_invariants: bool = False,
                      timeout: float = 10.0) -> m.StatusReport:
    with zmq.Context.instance().socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send(_codec.encode(m.StatusQuery(check_invariants)))
        if not sock.poll(int(timeout * 1000)):
            raise DaemonGone(f"no status from {address} within {timeout}s")
        return _answer(sock.recv())


def _answer(frame: bytes) -> m.StatusReport:
    answer = _codec.decode(frame)
    if isinstance(answer, m.Rejected):
        raise error_for(answer)
    return answer


_reply_codec = Codec(m.CONTROL_REPLIES)


async def send_command(address: str, command: object, *, timeout: float = 30.0) -> object:
    """Send one operator command (or `Subscribe`); return the daemon's answer."""
    with Socket(zmq.DEALER) as sock:
        sock.zmq.setsockopt(zmq.ROUTING_ID, os.urandom(8))
        sock.connect(address)
        await sock.send(_reply_codec.encode(command))
        with trio.move_on_after(timeout):
            return _reply(await sock.recv())
    raise DaemonGone(f"no answer from {address} within {timeout}s")


def send_command_sync(address: str, command: object, *, timeout: float = 30.0) -> object:
    with zmq.Context.instance().socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send(_reply_codec.encode(command))
        if not sock.poll(int(timeout * 1000)):
            raise DaemonGone(f"no answer from {address} within {timeout}s")
        return _reply(sock.recv())


def _reply(frame: bytes) -> object:
    answer = _reply_codec.decode(frame)
    if isinstance(answer, m.Rejected):
        raise error_for(answer)
    return answer
