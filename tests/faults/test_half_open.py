"""Half-open peers: a connection whose other end is gone, or silent, holds nothing for long.

The peer reaches the daemon through a TCP relay in the test; once the peer has a request
running, the relay stops carrying anything either way but keeps both connections open, as a
vanished host or a dead NAT entry would. The Stream's own heartbeat then finds the peer
silent: its request ends and its KV is released. A peer whose host is gone altogether is
dropped by the kernel's keepalive probes, which the daemon turns on for every client
connection (a relay's kernel answers those probes, so the test reads the socket options).
"""

from __future__ import annotations

import os
import socket

import trio

from sluice.ipc import messages as m

from support.raw_peer import RawPeer


async def relay(source: trio.SocketStream, sink: trio.SocketStream, carry: trio.Event) -> None:
    while True:
        data = await source.receive_some(65536)
        if not data:
            return
        if not carry.is_set():
            await sink.send_all(data)


async def test_a_silent_peer_loses_its_stream_and_its_blocks(null_daemon) -> None:
    handle = await null_daemon(**{"stream.heartbeat_interval": 0.2,
                                  "stream.heartbeat_timeout": 1.0})
    host, port = handle.listen.removeprefix("tcp://").rsplit(":", 1)
    gateway = handle.daemon.gateway
    frozen = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            [listener] = await trio.open_tcp_listeners(0, host="127.0.0.1")
            relay_port = listener.socket.getsockname()[1]

            async def serve_one() -> None:
                client_side = await listener.accept()
                daemon_side = await trio.open_tcp_stream(host, int(port))
                nursery.start_soon(relay, client_side, daemon_side, frozen)
                await relay(daemon_side, client_side, frozen)

            nursery.start_soon(serve_one)
            with RawPeer(f"tcp://127.0.0.1:{relay_port}") as peer:
                await peer.send(m.Generate("long", prompt="hi", credits=1,
                                           sampling=m.SamplingParams(max_tokens=30000,
                                                               ignore_eos=True)))
                assert isinstance(await peer.receive(), m.Accepted)
                assert len(gateway.streams) == 1
                frozen.set()  # from now on nothing passes either way
                while gateway.streams:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    # the autouse KV check then finds the long request's blocks released


def accepted_sockets(listen_port: int) -> list[socket.socket]:
    """This process's TCP connections accepted on `listen_port` (the daemon runs in it)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if sock.family == socket.AF_INET and sock.type == socket.SOCK_STREAM \
                    and sock.getsockname()[1] == listen_port and sock.getpeername():
                found.append(sock)
                continue
        except OSError:  # not a socket, or the listening one (no peer)
            pass
        sock.close()
    return found


async def test_client_connections_are_probed_by_tcp_keepalive(null_daemon) -> None:
    handle = await null_daemon(**{"stream.heartbeat_interval": 2.0,
                                  "stream.heartbeat_timeout": 7.0})
    listen_port = int(handle.listen.rsplit(":", 1)[1])
    with trio.fail_after(30), RawPeer(handle.listen) as peer:
        await peer.send(m.Describe())
        assert isinstance(await peer.receive(), m.ServerInfo)
        [accepted] = accepted_sockets(listen_port)
        with accepted:
            assert accepted.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 7
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 2
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) >= 1
