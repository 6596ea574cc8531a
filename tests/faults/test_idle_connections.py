"""Strangers' idle connections cannot keep the ZeroMQ front's cap full.

A connection holds a slot of the cap from its accept. One that holds no stream (it sent no
request, or its stream ended) and sends nothing is closed after `idle_connection_seconds`, and
at the cap the one idle longest (past a short grace) is closed to make room for a newcomer — so a crowd of idle connections
neither keeps a well-behaved client out nor stays for good. Each test ends with the KV check.
"""

from __future__ import annotations

import signal

import trio
import zmq
from zmq.utils.monitor import recv_monitor_message

from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status

CAP = 6
CONFIG = f"""
[limits]
max_connections = {CAP}
reserved_fds = 8
idle_connection_seconds = {{idle}}
"""


def watched_peer(context: zmq.Context, listen: str) -> tuple[zmq.Socket, zmq.Socket]:
    """An idle DEALER that never sends, and the PAIR its monitor events come on."""
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RECONNECT_IVL, 60_000)  # a closed one stays closed within a test
    events = peer.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    peer.connect(listen)
    return peer, events


def saw(events: zmq.Socket, event: int, timeout_ms: int) -> bool:
    while events.poll(timeout_ms):
        if recv_monitor_message(events)["event"] == event:
            return True
    return False


async def served(listen: str) -> None:
    async with AsyncClient(listen) as client:
        generation = await client.generate("past the idle crowd", max_tokens=3)
        assert (await generation.collect()).finish_reason == "length"


async def test_idle_connections_at_the_cap_make_room_and_leave_in_time(
        tmp_path, daemon_process, drained_and_consistent) -> None:
    config = tmp_path / "sluiced.toml"
    config.write_text(CONFIG.format(idle=3))
    process, listen, control = daemon_process(
        ["--executor", "null", "--config", str(config), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock"], log=tmp_path / "sluiced.log")
    context = zmq.Context()
    crowd = [watched_peer(context, listen) for _ in range(2 * CAP)]
    try:
        for _, events in crowd:  # all of them connected: the cap is full of idle strangers
            assert await trio.to_thread.run_sync(saw, events, zmq.EVENT_CONNECTED, 10_000)
        await trio.sleep(1.0)  # and idle past the grace a connection has before it may go
        with trio.fail_after(30):
            await served(listen)  # the newcomer is served: the idle longest made room
        # and no idle stranger stays past idle_connection_seconds
        for _, events in crowd:
            assert await trio.to_thread.run_sync(saw, events, zmq.EVENT_DISCONNECTED, 15_000)
        report = await fetch_status(control)
        # those past the cap and its one spare slot were turned away (the newcomer's room was
        # made by closing one more, unless the sweep had closed idle ones by then: a slow run)
        assert report.gateway.refused_connections >= len(crowd) - (CAP + 1)
    finally:
        for peer, events in crowd:
            events.close()
            peer.close()
        context.term()
    with trio.fail_after(30):
        await served(listen)
        await drained_and_consistent(control)
    process.send_signal(signal.SIGTERM)
    assert await trio.to_thread.run_sync(process.wait) == 0


async def test_a_client_with_a_stream_is_never_closed_for_idling(
        tmp_path, daemon_process, drained_and_consistent) -> None:
    config = tmp_path / "sluiced.toml"
    config.write_text(CONFIG.format(idle=1) + "[stream]\nheartbeat_interval = 0.2\n")
    process, listen, control = daemon_process(
        ["--executor", "null", "--config", str(config), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock"], log=tmp_path / "sluiced.log")
    with trio.fail_after(60):
        async with AsyncClient(listen) as client:
            # the client's own socket, watched: a close by the daemon would show here (the
            # client would reconnect by itself and hide it otherwise)
            events = client._socket.zmq.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            try:
                for round_ in range(3):  # a request, then idle past the timeout, in turn
                    generation = await client.generate(f"round {round_}", max_tokens=2)
                    assert (await generation.collect()).finish_reason == "length"
                    await trio.sleep(2.5)
                assert not events.poll(0)
            finally:
                events.close()
            assert (await fetch_status(control)).connections == 1
        await drained_and_consistent(control)
    process.send_signal(signal.SIGTERM)
    assert await trio.to_thread.run_sync(process.wait) == 0
