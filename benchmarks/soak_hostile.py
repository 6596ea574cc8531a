"""Hostile clients for the soak: raw DEALER sockets that speak the wire protocol by hand.

Each mode is one way a stranger can misuse the daemon (never read, flood, send oversize
frames, vanish mid-stream, cancel in storms, churn connections, hoard connections) and runs until `stop`. Every
loop is bounded in count and time, every socket has small high-water marks, and traffic goes
only to the daemon on loopback, so that this process cannot exhaust its own machine's memory
or file descriptors however the daemon behaves. Modes that read until their requests end
check that each accepted request got exactly one `Finished`.

What does not belong here: the well-behaved load (the client library, in `soak.py`) and
anything done to the daemon process (`soak_daemon.py`, `soak_faults.py`).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import contextmanager
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

_client_codec = Codec(m.CLIENT_MESSAGES)
_server_codec = Codec(m.SERVER_MESSAGES, max_frame_bytes=64 * 1024 * 1024)

# connection identity (hex) -> the mode that opened it, so a fault that names a connection
# can be attributed; a few thousand entries in a long run
OWNERS: dict[str, str] = {}


@dataclass
class Plan:
    """How hard the hostile modes push; `soak.py` scales it to the executor."""

    max_tokens: int  # for requests meant to run long (non-readers, disconnects)
    max_frame_bytes: int  # the daemon's limit; oversize frames are a multiple of it
    request_timeout: float  # how long a short request may take before its Finished is missing
    non_readers: int = 4  # connections at once
    flooders: int = 2
    # per flooding connection: the answers (~60 bytes each) must overflow the kernel's
    # socket buffers (a few MB) and the daemon's per-peer queue before the daemon notices
    flood_frames: int = 200_000
    hold_seconds: float = 10.0  # how long a non-reader or flooder keeps its connection
    storm_requests: int = 16  # per cancel storm
    hoard_connections: int = 96  # held at once; more than the daemon's connection cap


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
        return self.send_frame(_client_codec.encode(msg))

    async def read(self, timeout: float) -> list:
        """The messages of the next frame; [] when none came within `timeout`."""
        with trio.move_on_after(timeout):
            try:
                return _server_codec.decode_batch(await self.sock.recv())
            except CodecError as exc:
                self.tally.outcomes[f"undecodable reply: {exc.message[:60]}"] += 1
                return []
        return []

    def close(self) -> None:
        self.sock.close()


_gate: trio.Event | None = None  # set while new hostile connections are held back


async def connect(listen: str, tally: Tally, **options: int) -> RawClient:
    """A new hostile connection, once no fault holds new connections back."""
    while _gate is not None:
        await _gate.wait()
    return RawClient(listen, tally, **options)


@contextmanager
def connections_held():
    """Hold new hostile connections back: the `vanish_stream` fault drops the newest
    connection's stream, and it must be the fault's own decoy."""
    global _gate
    gate = _gate = trio.Event()
    try:
        yield
    finally:
        _gate = None
        gate.set()


def generate(rid: str, max_tokens: int, *, credits: int = 16, prompt: str = "") -> m.Generate:
    return m.Generate(rid, prompt=f"{PROMPT_MARK} {prompt}",
                      sampling=m.Sampling(max_tokens=max_tokens, temperature=0.0,
                                          ignore_eos=True), credits=credits)


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
    tally.missing_finished += sum(1 for rid in accepted if finishes[rid] == 0)
    tally.duplicate_finished += sum(1 for n in finishes.values() if n > 1)
    tally.outcomes["finished_without_accepted"] += sum(1 for r in finishes if r not in accepted)
    tally.outcomes["no answer"] += sum(1 for r in open_rids if r not in accepted)


async def _pause(stop: trio.Event, seconds: float) -> None:
    with trio.move_on_after(seconds):
        await stop.wait()


# -- the modes -------------------------------------------------------------------------------


async def non_reader(listen: str, plan: Plan, tally: Tally, stop: trio.Event) -> None:
    """Ask for long generations with all the credits allowed, keep sending heartbeats (so
    the daemon cannot call it silent), and never read a byte."""
    while not stop.is_set():
        client = await connect(listen, tally, rcvhwm=16, rcvbuf=4096)
        try:
            for i in range(4):
                client.send(generate(f"nr{i}", plan.max_tokens, credits=4096))
            for _ in range(int(plan.hold_seconds / 0.5)):
                client.send(m.Heartbeat())
                await _pause(stop, 0.5)
                if stop.is_set():
                    break
        finally:
            client.close()


async def flood(listen: str, plan: Plan, tally: Tally, stop: trio.Event) -> None:
    """Send `Describe` as fast as the socket takes it, never reading the answers."""
    frame = _client_codec.encode(m.Describe())
    while not stop.is_set():
        client = await connect(listen, tally, rcvhwm=16, rcvbuf=4096)
        try:
            sent = 0
            with trio.move_on_after(plan.hold_seconds):
                while sent < plan.flood_frames and not stop.is_set():
                    if client.send_frame(frame):
                        sent += 1
                        if sent % 200 == 0:
                            await trio.sleep(0)
                    else:
                        await trio.sleep(0.01)
                await _pause(stop, plan.hold_seconds)  # hold the unread answers a while
        finally:
            client.close()


async def oversize(listen: str, plan: Plan, tally: Tally, stop: trio.Event) -> None:
    """Once a second, a fresh connection sends one frame 4x the daemon's frame limit."""
    frame = _client_codec.encode(
        generate("big", 4, prompt="x" * (4 * plan.max_frame_bytes)))
    while not stop.is_set():
        client = await connect(listen, tally)
        try:
            client.send_frame(frame)
            answer = await client.read(3.0)
            if not answer:
                tally.outcomes["no reply within 3s"] += 1
            for msg in answer:
                if isinstance(msg, m.Rejected):
                    tally.rejected[f"{msg.code.name.lower()}/{msg.field}"] += 1
                else:
                    tally.outcomes[type(msg).__name__] += 1
        finally:
            client.close()
        await _pause(stop, 1.0)


async def disconnect(listen: str, plan: Plan, tally: Tally, stop: trio.Event) -> None:
    """Start a long generation, take its first chunk, and vanish without a word."""
    n = 0
    while not stop.is_set():
        client = await connect(listen, tally)
        try:
            n += 1
            client.send(generate(f"dc{n}", plan.max_tokens, credits=4))
            got_chunk = False
            with trio.move_on_after(10.0):
                while not got_chunk:
                    client.send(m.Heartbeat())  # still here, until it vanishes
                    for msg in await client.read(HEARTBEAT_SECONDS):
                        if isinstance(msg, m.Accepted):
                            tally.accepted += 1
                        got_chunk = got_chunk or isinstance(msg, (m.Chunk, m.Finished,
                                                                  m.Rejected))
            tally.outcomes["left mid-stream" if got_chunk else "left before a chunk (10s)"] += 1
        finally:
            client.close()
        await _pause(stop, 0.5)


async def cancel_storm(listen: str, plan: Plan, tally: Tally, stop: trio.Event) -> None:
    """Send a burst of requests and cancel each at once, twice, plus ids that never
    existed; then wait for every accepted request's one `Finished`."""
    storm = 0
    while not stop.is_set():
        client = await connect(listen, tally)
        try:
            storm += 1
            rids = {f"s{storm}-{i}" for i in range(plan.storm_requests)}
            for rid in sorted(rids):
                client.send(generate(rid, plan.max_tokens))
                client.send(m.Cancel(rid))
            for rid in sorted(rids):
                client.send(m.Cancel(rid))
            client.send(m.Cancel(f"never-sent-{storm}"))
            await read_until_ended(client, rids, timeout=plan.request_timeout)
        finally:
            client.close()
        await _pause(stop, 0.5)


async def churn(listen: str, plan: Plan, tally: Tally, stop: trio.Event) -> None:
    """Connect, do one small thing (a `Describe` or a 2-token request), leave; repeat."""
    n = 0
    while not stop.is_set():
        n += 1
        client = await connect(listen, tally)
        try:
            if n % 2:
                client.send(m.Describe())
                answer = await client.read(3.0)
                tally.outcomes["described" if answer else "no ServerInfo within 3s"] += 1
            else:
                client.send(generate("c", 2))
                await read_until_ended(client, {"c"}, timeout=plan.request_timeout, grace=0.05)
        finally:
            client.close()
        await _pause(stop, 0.05)


async def hoard(listen: str, plan: Plan, tally: Tally, stop: trio.Event) -> None:
    """Open more connections than the daemon's cap allows, each with one small request,
    and keep them all alive with heartbeats for a while; then let go, and again."""
    while not stop.is_set():
        clients: list[RawClient] = []
        try:
            for _ in range(plan.hoard_connections):
                clients.append(await connect(listen, tally))
                clients[-1].send(generate("h", 1))
            async with trio.open_nursery() as nursery:
                for client in clients:
                    nursery.start_soon(read_until_ended, client, {"h"}, plan.request_timeout)
            for _ in range(int(plan.hold_seconds / HEARTBEAT_SECONDS)):
                for client in clients:
                    client.send(m.Heartbeat())
                await _pause(stop, HEARTBEAT_SECONDS)
                if stop.is_set():
                    break
        finally:
            for client in clients:
                client.close()
        await _pause(stop, 2.0)


Mode = Callable[[str, Plan, Tally, trio.Event], Awaitable[None]]

MODES: dict[str, Mode] = {
    "non_reader": non_reader, "flood": flood, "oversize": oversize,
    "disconnect": disconnect, "cancel_storm": cancel_storm, "churn": churn, "hoard": hoard,
}


def loops(name: str, plan: Plan) -> int:
    """How many loops of a mode run at once."""
    return {"non_reader": plan.non_readers, "flood": plan.flooders, "disconnect": 2,
            "churn": 2}.get(name, 1)
