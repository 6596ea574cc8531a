"""Running out of file descriptors costs messages, never the daemon.

The connection cap derived from the fd limit normally keeps the daemon clear of `EMFILE`;
here the cap is configured far above what the descriptors allow and the daemon's fd limit
is lowered while it runs, so connections do run it out of descriptors. Each connection past
that point is refused (`Rejected(overloaded)`, field `connections`) or loses its messages;
the daemon keeps running, serves once the connections are gone, and exits 0. (The control
socket is left alone while descriptors are out: libzmq aborts on a failed ipc:// accept.)
"""

from __future__ import annotations

import os
import resource
import signal

import trio
import zmq

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.codec import Codec
from sluice.ipc.control import fetch_status

CONFIG = """
[limits]
max_connections = 10000

[stream]
heartbeat_interval = 0.5
heartbeat_timeout = 2.0
"""
SPARE_FDS = 40
CONNECTIONS = 60

server_codec = Codec(m.SERVER_MESSAGES)
client_codec = Codec(m.CLIENT_MESSAGES)


async def test_connections_past_the_fd_limit_cost_only_themselves(
        tmp_path, daemon_process, drained_and_consistent) -> None:
    config = tmp_path / "sluiced.toml"
    config.write_text(CONFIG)
    process, listen, control = daemon_process(
        ["--executor", "null", "--config", str(config), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock"], log=tmp_path / "sluiced.log")
    in_use = len(os.listdir(f"/proc/{process.pid}/fd"))
    resource.prlimit(process.pid, resource.RLIMIT_NOFILE, (in_use + SPARE_FDS,) * 2)
    context = zmq.Context.instance()
    peers = []
    try:
        for i in range(CONNECTIONS):
            peer = context.socket(zmq.DEALER)
            peer.setsockopt(zmq.LINGER, 0)
            peer.connect(listen)
            peer.send(client_codec.encode(m.Generate("r", prompt="hi",
                                                     sampling=m.SamplingParams(max_tokens=2))))
            peers.append(peer)
        await trio.sleep(5)
        assert process.poll() is None, "the daemon died"
        refused = 0
        for peer in peers:
            while peer.poll(0):
                for msg in server_codec.decode_batch(peer.recv()):
                    refused += isinstance(msg, m.Rejected) and msg.field == "connections"
        assert refused >= 1
    finally:
        for peer in peers:
            peer.close()
    with trio.fail_after(60):
        # libzmq aborts the process when an ipc:// listener (the control socket) cannot
        # accept for want of a descriptor (the reason for `reserved_fds`): wait, from outside,
        # until the closed connections' streams timed out and gave their descriptors back
        while len(os.listdir(f"/proc/{process.pid}/fd")) > in_use + SPARE_FDS // 2:
            await trio.sleep(0.2)
        while (await fetch_status(control)).connections > 0:
            await trio.sleep(0.2)
        async with AsyncClient(listen) as client:
            generation = await client.generate("served again", max_tokens=3)
            assert (await generation.collect()).finish_reason == "length"
        report = await fetch_status(control)
        assert report.gateway.refused_connections >= refused
        await drained_and_consistent(control)
        process.send_signal(signal.SIGTERM)
        assert await trio.to_thread.run_sync(process.wait) == 0
