"""A half-open peer (its TCP connection alive, nobody behind it) is cleared by ZeroMQ's own
heartbeats: the daemon closes that connection itself, whether or not a frame is due.

The peer reaches the daemon through a TCP relay in the test; once the peer was answered, the
relay stops carrying anything either way but keeps both connections open, as a vanished
host or a dead NAT entry would. The daemon's pings then go unanswered and it hangs up.
"""

from __future__ import annotations

import trio

from sluice.ipc import messages as m

from raw_peer import RawPeer


async def relay(source: trio.SocketStream, sink: trio.SocketStream, carry: trio.Event) -> None:
    while True:
        data = await source.receive_some(65536)
        if not data:
            return
        if not carry.is_set():
            await sink.send_all(data)


async def test_a_half_open_peer_is_hung_up_on(null_daemon) -> None:
    handle = await null_daemon(**{"stream.heartbeat_interval": 0.2,
                                  "stream.heartbeat_timeout": 1.0})
    host, port = handle.listen.removeprefix("tcp://").rsplit(":", 1)
    frozen = trio.Event()
    hung_up = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            [listener] = await trio.open_tcp_listeners(0, host="127.0.0.1")
            relay_port = listener.socket.getsockname()[1]

            async def serve_one() -> None:
                client_side = await listener.accept()
                daemon_side = await trio.open_tcp_stream(host, int(port))
                nursery.start_soon(relay, client_side, daemon_side, frozen)
                try:  # the daemon's side: ends when the daemon hangs up
                    await relay(daemon_side, client_side, frozen)
                except trio.BrokenResourceError:
                    pass
                hung_up.set()

            nursery.start_soon(serve_one)
            with RawPeer(f"tcp://127.0.0.1:{relay_port}") as peer:
                await peer.send(m.Describe())
                assert isinstance(await peer.receive(), m.ServerInfo)
                frozen.set()  # from now on nothing passes either way
                await hung_up.wait()
            nursery.cancel_scope.cancel()
