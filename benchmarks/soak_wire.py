"""Speaking the wire protocol by hand, for the soak's hostile clients.

A `RawClient` is one DEALER connection with small high-water marks that sends without ever
waiting; `read_until_ended` reads a connection's requests to their end (sending heartbeats,
as any client must) and checks that each accepted request got exactly one `Finished`; a
`Tally` counts what one hostile mode did and what came back. The modes themselves are in
`soak_hostile.py`.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field

import trio
import zmq

from sluice.ipc import messages as m
from sluice.ipc.codec import Codec, CodecError
from sluice.ipc.sockets import Socket

# how often a client that waits says it is still there (the soak's daemon times out at 3 s)
HEARTBEAT_SECONDS = 0.5

# put in every prompt the soak sends, so the daemon's log can be searched for prompt text
PROMPT_MARK = "soak-prompt-text-7f3a"

# the hostile clients' tenant: the daemon promises isolation between tenants (fair shares,
# caps), not between the clients of one tenant, so strangers get a tenant of their own, with
# the limits an operator gives one (`soak_daemon.CONFIG`); the well-behaved use "default"
HOSTILE_TENANT = "strangers"

client_codec = Codec(m.CLIENT_MESSAGES)
_server_codec = Codec(m.SERVER_MESSAGES, max_frame_bytes=64 * 1024 * 1024)

# connection identity (hex) -> the mode that opened it, so a fault that names a connection
# can be attributed; a few thousand entries in a long run
OWNERS: dict[str, str] = {}


@dataclass
class Tally:
    """What one mode did and what came back."""

    mode: str
    connections: int = 0
    frames_sent: int = 0
    send_refused: int = 0  # our side's queue was full: the daemon was not reading
    accepted: int = 0
    rejected: Counter = field(default_factory=Counter)  # "code/field" -> n
    finished: Counter = field(default_factory=Counter)  # reason -> n
    missing_finished: int = 0  # accepted, waited for, no Finished came
    # the first few of those, to find in the daemon's log: connection, request id, when
    missing_examples: list = field(default_factory=list)
    duplicate_finished: int = 0  # more than one Finished for one request
    outcomes: Counter = field(default_factory=Counter)  # mode-specific observations

    def report(self) -> dict:
        out = {k: v for k, v in self.__dict__.items()
               if not isinstance(v, Counter) and k != "mode"}
        out.update({k: dict(v) for k, v in self.__dict__.items() if isinstance(v, Counter)})
        return out


class RawClient:
    """One hostile connection; `close()` drops it at once (no linger)."""

    def __init__(self, listen: str, tally: Tally, *, rcvhwm: int = 64, sndhwm: int = 1000,
                 rcvbuf: int = -1):
        self.sock = Socket(zmq.DEALER)
        self.identity = os.urandom(8)
        OWNERS[self.identity.hex()] = tally.mode
        self.sock.zmq.setsockopt(zmq.ROUTING_ID, self.identity)
        self.sock.zmq.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.zmq.setsockopt(zmq.SNDHWM, sndhwm)
        # a non-reader with a small kernel buffer fills the daemon's side sooner
        self.sock.zmq.setsockopt(zmq.RCVBUF, rcvbuf)
        self.sock.connect(listen)
        self.tally = tally
        tally.connections += 1

    def send_frame(self, frame: bytes) -> bool:
        """Queue one frame without waiting; False when our side's queue is full."""
        try:
            self.sock.zmq.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            self.tally.send_refused += 1
            return False
        self.tally.frames_sent += 1
        return True

    def send(self, msg: object) -> bool:
        return self.send_frame(client_codec.encode(msg))

    async def read(self, timeout: float) -> list:
        """The messages of the next frame; [] when none came within `timeout`."""
        with trio.move_on_after(timeout):
            try:
                return _server_codec.decode_batch(await self.sock.recv())
            except CodecError as exc:
                self.tally.outcomes[f"undecodable reply: {exc.message[:60]}"] += 1
                return []
        return []

    def poll_frame(self) -> list | None:
        """The messages of a frame already received, without waiting; None when there is none."""
        try:
            return _server_codec.decode_batch(self.sock.zmq.recv(zmq.NOBLOCK))
        except zmq.Again:
            return None
        except CodecError as exc:
            self.tally.outcomes[f"undecodable reply: {exc.message[:60]}"] += 1
            return []

    def close(self) -> None:
        self.sock.close()


def generate(rid: str, max_tokens: int, *, credits: int = 16, prompt: str = "") -> m.Generate:
    return m.Generate(rid, prompt=f"{PROMPT_MARK} {prompt}",
                      sampling=m.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                ignore_eos=True),
                      tenant=HOSTILE_TENANT, credits=credits)


async def read_until_ended(client: RawClient, rids: set[str], timeout: float,
                           grace: float = 0.3) -> None:
    """Read until every request in `rids` is refused or finished, then `grace` seconds more
    to catch a second `Finished`; count what came in the client's tally. Heartbeats go out
    meanwhile, as any client's must: a silent one is gone, and is sent nothing more."""
    tally = client.tally
    accepted: set[str] = set()
    finishes: Counter = Counter()
    open_rids = set(rids)

    def take(batch: list) -> None:
        for msg in batch:
            rid = getattr(msg, "request_id", "")
            if isinstance(msg, m.Accepted):
                accepted.add(rid)
            elif isinstance(msg, m.Rejected):
                tally.rejected[f"{msg.code.name.lower()}/{msg.field}"] += 1
                open_rids.discard(rid)
            elif isinstance(msg, m.Finished):
                finishes[rid] += 1
                tally.finished[msg.reason.name.lower()] += 1
                open_rids.discard(rid)

    read_from = time.time()  # wall clock, as the daemon's log has it
    deadline = trio.current_time() + timeout
    next_beat = trio.current_time()
    while open_rids and trio.current_time() < deadline:
        if trio.current_time() >= next_beat:
            client.send(m.Heartbeat())
            next_beat = trio.current_time() + HEARTBEAT_SECONDS
        take(await client.read(min(HEARTBEAT_SECONDS, deadline - trio.current_time())))
    deadline = trio.current_time() + grace
    while trio.current_time() < deadline:
        take(await client.read(max(0.0, deadline - trio.current_time())))
    tally.accepted += len(accepted)
    missing = [rid for rid in accepted if finishes[rid] == 0]
    tally.missing_finished += len(missing)
    for rid in missing[:max(0, 8 - len(tally.missing_examples))]:
        tally.missing_examples.append({"connection": client.identity.hex(), "request_id": rid,
                                       "read_from_unix": round(read_from, 2),
                                       "gave_up_unix": round(time.time(), 2)})
    tally.duplicate_finished += sum(1 for n in finishes.values() if n > 1)
    tally.outcomes["finished_without_accepted"] += sum(1 for r in finishes if r not in accepted)
    tally.outcomes["no answer"] += sum(1 for r in open_rids if r not in accepted)
