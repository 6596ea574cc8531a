"""A client that floods and never reads costs only its own connection.

The daemon runs as its own process: a gateway loop that never yields would also stop a
daemon inside the test's event loop, and with it the test's own timeout. Each flood is
verifiably stuck (the daemon reports the flooder forgotten, or the flooder's own sends are
refused because the daemon stopped reading) before a well-behaved client asks for a
generation; that client, `status` (through the library and through `sluice status --json`)
and SIGTERM must all work while the flood goes on, and the KV invariant holds at the end.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import trio
import zmq

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.codec import Codec
from sluice.ipc.control import fetch_status
from sluice.ipc.errors import DaemonGone

from support.flooders import Flooder

# a small per-peer queue so the flood fills it quickly; the kernel's socket buffers still
# hold tens of thousands of small frames before the daemon's send is refused
CONFIG = """
[limits]
peer_send_hwm = 16
{limits}

[null]
max_model_len = 32768
"""

codec = Codec(m.CLIENT_MESSAGES)


def start(daemon_process, tmp_path, more_config: str = "", limits: str = ""):
    config = tmp_path / "sluiced.toml"
    config.write_text(CONFIG.format(limits=limits) + more_config)
    return daemon_process(
        ["--executor", "null", "--config", str(config), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock", "--drain-deadline", "10"],
        log=tmp_path / "sluiced.log",
    )


async def status_or_none(control: str) -> m.StatusReport | None:
    try:
        return await fetch_status(control, timeout=3)
    except DaemonGone:
        return None


async def wait_until_stuck(control: str, flooder: Flooder) -> None:
    """Until the daemon forgot the flooder, or (a frozen daemon) stopped reading it."""
    with trio.fail_after(120):
        while flooder.blocked_for() < 3:
            report = await status_or_none(control)
            if report is not None and report.gateway.forgotten_peers >= 1:
                return
            await trio.sleep(0.2)


async def serve_a_good_client(listen: str) -> None:
    with trio.fail_after(30):
        async with AsyncClient(listen, daemon_timeout=10) as client:
            generation = await client.generate("hello", max_tokens=8, temperature=0)
            result = await generation.collect()
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 8


async def serve_a_good_client_during_the_flood(listen: str, control: str, drained) -> None:
    await serve_a_good_client(listen)
    with trio.fail_after(30):
        first = await fetch_status(control)
        assert first.gateway.forgotten_peers >= 1
        # the flood goes on, and the daemon goes on dropping it
        while (await fetch_status(control)).gateway.dropped_frames <= first.gateway.dropped_frames:
            await trio.sleep(0.2)
    await drained(control)


async def sigterm_exits_zero(process) -> None:
    process.send_signal(signal.SIGTERM)
    with trio.fail_after(60):
        code = await trio.to_thread.run_sync(process.wait)
    assert code == 0


async def test_describe_flood_that_never_reads_costs_only_the_flooder(
        tmp_path, daemon_process, drained_and_consistent) -> None:
    process, listen, control = start(daemon_process, tmp_path)
    with Flooder(listen, [], codec.encode(m.Describe())) as flooder:
        await wait_until_stuck(control, flooder)
        await serve_a_good_client_during_the_flood(listen, control, drained_and_consistent)
        cli = await trio.to_thread.run_sync(lambda: subprocess.run(
            [sys.executable, "-m", "sluice.daemon.cli", "status", "--json",
             "--connect-control", control], capture_output=True, text=True, timeout=60))
        assert cli.returncode == 0, cli.stderr
        edge = json.loads(cli.stdout)["gateway"]
        assert edge["forgotten_peers"] >= 1 and edge["dropped_frames"] >= 1
        await sigterm_exits_zero(process)


async def test_huge_credits_with_a_client_that_never_reads(
        tmp_path, daemon_process, drained_and_consistent) -> None:
    # an operator who trusts clients raised the clamp: a non-reader's chunks may then outgrow
    # the socket buffers between the daemon and it (the default clamp pauses it long before)
    process, listen, control = start(daemon_process, tmp_path, limits="max_credits = 1000000")
    # 64 long requests, each granting ~2**31 credits up front: every chunk may be sent at once,
    # far more than the socket buffers between the daemon and the flooder hold
    generates = [codec.encode(m.Generate(f"g{i}", prompt="flood", credits=2**31 - 1,
                                         sampling=m.SamplingParams(max_tokens=30000, ignore_eos=True)))
                 for i in range(64)]
    with Flooder(listen, generates, codec.encode(m.Heartbeat())) as flooder:
        await wait_until_stuck(control, flooder)
        await serve_a_good_client_during_the_flood(listen, control, drained_and_consistent)
        await sigterm_exits_zero(process)


def flood_then_vanish(listen: str, peers: int, seconds: float) -> None:
    """`peers` connections send undecodable frames for `seconds`, faster than the daemon can
    read them, and then drop their connections with frames still queued."""
    context = zmq.Context.instance()
    sockets = []
    for _ in range(peers):
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(listen)
        sockets.append(sock)
    junk = b"\xc1" * 64  # never valid msgpack: each one is worth a Rejected
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        for sock in sockets:
            for _ in range(200):
                sock.send(junk, zmq.NOBLOCK)
    for sock in sockets:
        sock.close(0)


async def test_flooders_that_hang_up_mid_flood_cost_nothing_but_themselves(
        tmp_path, daemon_process, drained_and_consistent) -> None:
    # fast heartbeats: with ZeroMQ's own pings on the client socket, one falling due on a
    # connection whose peer hung up while its inbound queue was full aborted the daemon
    process, listen, control = start(daemon_process, tmp_path, """
[stream]
heartbeat_interval = 0.05
heartbeat_timeout = 2.0
""")
    for _ in range(3):
        await trio.to_thread.run_sync(flood_then_vanish, listen, 48, 0.5)
        await trio.sleep(0.3)
        assert process.poll() is None, "the daemon died"
    await serve_a_good_client(listen)
    await drained_and_consistent(control)
    await sigterm_exits_zero(process)
