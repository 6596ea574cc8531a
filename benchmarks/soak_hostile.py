"""Hostile clients for the soak: raw DEALER sockets that speak the wire protocol by hand.

Each mode is one way a stranger can misuse the daemon (never read, flood, send oversize
frames, vanish mid-stream, cancel in storms, churn connections, hoard connections, open
hundreds at once, churn connections that send garbage) and runs until `stop`. The ZeroMQ
modes speak to the daemon's client address, tcp:// or ipc://; the `http_*` modes, in
`soak_http_hostile.py`, to its HTTP front. Every loop is bounded in count and time, every
socket has small high-water marks, and traffic goes only to the daemon on loopback, so that
this process cannot exhaust its own machine's memory or file descriptors however the daemon
behaves. Modes that read until their requests end check that each accepted request got
exactly one `Finished`. The protocol spoken by hand is in `soak_wire.py`.

`soak.py` runs the modes in a process of their own (`command` below), as strangers' clients
are: sharing one event loop, a flooder's sending would delay the well-behaved clients'
reading, a cost the daemon did not cause.

What does not belong here: the well-behaved load (the client library, in `soak.py`) and
anything done to the daemon process (`soak_daemon.py`, `soak_faults.py`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import trio
import zmq

from sluice.ipc import messages as m
from sluice.ipc import sockets

from soak_http_hostile import HTTP_MODES
from soak_wire import (HEARTBEAT_SECONDS, RawClient, Tally, client_codec, generate,
                       read_until_ended)


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
    flood_connections: int = 512  # opened at once by a connection flood, past cap and budget
    # garbage churn: connections a second per loop, each sending ~50 frames of 1-300 bytes
    # (over TCP every one leaves a port in TIME_WAIT for a minute: this rate stays clear of
    # the ephemeral range)
    garbage_rate: float = 100.0
    max_rounds: int = 200_000  # per loop of a mode, whatever the time left
    # the HTTP front, when an http_* mode runs: HOST:PORT, the strangers' key, the model name
    http: str = ""
    http_key: str = ""
    http_trickle_key: str = ""  # the tricklers' tenant's
    http_model: str = ""
    http_flood_connections: int = 256  # held at once; twice the front's connection cap
    tricklers: int = 20  # bodies trickled at once; more than their tenant's share of reads


async def _pause(stop: trio.Event, seconds: float) -> None:
    with trio.move_on_after(seconds):
        await stop.wait()


# -- the modes -------------------------------------------------------------------------------


async def non_reader(listen: str, plan: Plan, tally: Tally, stop: trio.Event) -> None:
    """Ask for long generations with all the credits allowed, keep sending heartbeats (so
    the daemon cannot call it silent), and never read a byte."""
    while not stop.is_set():
        client = RawClient(listen, tally, rcvhwm=16, rcvbuf=4096)
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
    frame = client_codec.encode(m.Describe())
    while not stop.is_set():
        client = RawClient(listen, tally, rcvhwm=16, rcvbuf=4096)
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
    frame = client_codec.encode(
        generate("big", 4, prompt="x" * (4 * plan.max_frame_bytes)))
    while not stop.is_set():
        client = RawClient(listen, tally)
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
        client = RawClient(listen, tally)
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
        client = RawClient(listen, tally)
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
        client = RawClient(listen, tally)
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
                clients.append(RawClient(listen, tally))
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


async def conn_flood(listen: str, plan: Plan, tally: Tally, stop: trio.Event) -> None:
    """Open `flood_connections` at once, each asking for a 2-token generation (a stream, the
    costliest kind of connection), with no heartbeat and no read; hold them a few seconds,
    count what came back, close them all, again. Past its cap and budget the daemon refuses
    or sheds them; those it took time out silent."""
    for _ in range(plan.max_rounds):
        if stop.is_set():
            break
        clients: list[RawClient] = []
        try:
            for i in range(plan.flood_connections):
                clients.append(RawClient(listen, tally, rcvhwm=4))
                clients[-1].send(generate(f"f{i}", 2))
                if i % 64 == 63:
                    await trio.sleep(0)
            await _pause(stop, plan.hold_seconds / 2)
            for client in clients:  # the first frame each got, if any
                answer = client.poll_frame()
                if not answer:
                    tally.outcomes["no answer within the hold"] += 1
                elif isinstance(answer[0], m.Accepted):
                    tally.accepted += 1
                elif isinstance(answer[0], m.Rejected):
                    tally.rejected[f"{answer[0].code.name.lower()}/{answer[0].field}"] += 1
                else:
                    tally.outcomes[f"first answer: {type(answer[0]).__name__}"] += 1
        finally:
            for client in clients:
                client.close()
        await _pause(stop, 1.0)


async def garbage_churn(listen: str, plan: Plan, tally: Tally, stop: trio.Event) -> None:
    """Connect, send ~50 frames of 1-300 random bytes (no message at all), leave; repeat,
    `garbage_rate` times a second. Each connection lingers up to 100 ms after its close, so
    that what it sent reaches the daemon: what the daemon may queue of it is bounded by its
    inbound budget, and its memory must stay put."""
    rng = random.Random(0)
    garbage = rng.randbytes(4096)
    started = trio.current_time()
    for turn in range(plan.max_rounds):
        if stop.is_set():
            break
        peer = sockets.context().socket(zmq.DEALER)
        tally.connections += 1
        try:
            peer.connect(listen)
            for _ in range(rng.randint(40, 60)):
                start = rng.randrange(len(garbage) - 300)
                try:
                    peer.send(garbage[start:start + rng.randint(1, 300)], zmq.NOBLOCK)
                    tally.frames_sent += 1
                except zmq.Again:
                    tally.send_refused += 1
        finally:
            peer.close(linger=100)
        await trio.sleep_until(started + (turn + 1) / plan.garbage_rate)


Mode = Callable[[str, Plan, Tally, trio.Event], Awaitable[None]]

ZMQ_MODES: dict[str, Mode] = {
    "non_reader": non_reader, "flood": flood, "oversize": oversize,
    "disconnect": disconnect, "cancel_storm": cancel_storm, "churn": churn, "hoard": hoard,
    "conn_flood": conn_flood, "garbage_churn": garbage_churn,
}
MODES: dict[str, Mode] = {**ZMQ_MODES, **HTTP_MODES}
# names that stand for several modes on the command line
GROUPS = {"zmq": list(ZMQ_MODES), "http": list(HTTP_MODES)}


def loops(name: str, plan: Plan) -> int:
    """How many loops of a mode run at once."""
    return {"non_reader": plan.non_readers, "flood": plan.flooders, "disconnect": 2,
            "churn": 2, "garbage_churn": 2, "http_trickle": plan.tricklers,
            "http_non_reader": plan.non_readers}.get(name, 1)


def command(listen: str, plan: Plan, modes: list[str], seconds: float) -> list[str]:
    """The command line that runs `modes` against `listen` for `seconds` in a new process;
    it prints each mode's tally as one JSON object."""
    return [sys.executable, str(Path(__file__)), "--listen", listen, "--modes", ",".join(modes),
            "--seconds", str(seconds), "--plan", json.dumps(asdict(plan))]


async def _run(listen: str, plan: Plan, tallies: dict[str, Tally], seconds: float) -> None:
    stop = trio.Event()
    # every mode's waits are bounded by the request timeout: this bounds the whole run
    with trio.move_on_after(seconds + plan.request_timeout + 2):
        async with trio.open_nursery() as nursery:
            for name, tally in tallies.items():
                for _ in range(loops(name, plan)):
                    nursery.start_soon(MODES[name], listen, plan, tally, stop)
            await trio.sleep(seconds)
            stop.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="hostile clients against a daemon")
    parser.add_argument("--listen", required=True)
    parser.add_argument("--modes", required=True, help=f"comma-separated: {', '.join(MODES)}")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--plan", required=True, help="the Plan's fields as JSON")
    args = parser.parse_args(argv)
    tallies = {name: Tally(name) for name in args.modes.split(",") if name}
    trio.run(_run, args.listen, Plan(**json.loads(args.plan)), tallies, args.seconds)
    print(json.dumps({name: tally.report() for name, tally in tallies.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
