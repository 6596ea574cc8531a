"""The trio adapter over ZeroMQ: no lost wakeups on the edge-triggered FD, no silent drops."""

from __future__ import annotations

import pytest
import trio
import zmq

from sluice.ipc.sockets import PeerGone, Socket


async def test_many_messages_both_ways_with_concurrent_senders() -> None:
    with trio.fail_after(20), Socket(zmq.ROUTER) as router, Socket(zmq.DEALER) as dealer:
        address = router.bind("tcp://127.0.0.1:0")
        dealer.connect(address)
        count = 2000
        got_at_router: list[bytes] = []
        got_at_dealer: list[bytes] = []

        async def dealer_sender(tag: bytes) -> None:
            for i in range(count // 2):
                await dealer.send(tag + str(i).encode())

        async def router_echo() -> None:
            for _ in range(count):
                identity, payload = await router.recv_multipart()
                got_at_router.append(payload)
                await router.send_multipart([identity, payload])

        async def dealer_receiver() -> None:
            for _ in range(count):
                got_at_dealer.append(await dealer.recv())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(router_echo)
            nursery.start_soon(dealer_receiver)
            nursery.start_soon(dealer_sender, b"a")
            nursery.start_soon(dealer_sender, b"b")
        assert sorted(got_at_dealer) == sorted(got_at_router)
        assert len(set(got_at_dealer)) == count


async def test_router_raises_peer_gone_for_unknown_identity() -> None:
    with trio.fail_after(5), Socket(zmq.ROUTER) as router:
        router.bind("inproc://peer-gone-test")
        with pytest.raises(PeerGone) as info:
            await router.send_multipart([b"nobody", b"hello"])
        assert info.value.identity == b"nobody"


async def test_receiver_wakes_after_peer_sends_later() -> None:
    with trio.fail_after(5), Socket(zmq.PAIR) as a, Socket(zmq.PAIR) as b:
        a.bind("inproc://late-sender")
        b.connect("inproc://late-sender")
        async with trio.open_nursery() as nursery:

            async def later() -> None:
                await trio.sleep(0.05)
                await b.send(b"late")

            nursery.start_soon(later)
            assert await a.recv() == b"late"


async def test_closing_wakes_a_blocked_receiver() -> None:
    with trio.fail_after(5):
        sock = Socket(zmq.PAIR)
        sock.bind("inproc://close-wakes")

        async def receive() -> None:
            with pytest.raises(trio.ClosedResourceError):
                await sock.recv()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            await trio.sleep(0.05)
            sock.close()


async def _arrived(sock: Socket) -> None:
    while not sock.zmq.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        await trio.sleep(0.01)


@pytest.mark.parametrize("receive", ["recv", "recv_multipart"])
async def test_a_receive_cut_short_by_a_timeout_loses_no_message(receive: str) -> None:
    """A timeout that falls due as a message arrives: either the receive returns it, or it
    raises and the message is still there for the next one, never both lost."""
    with trio.fail_after(5), Socket(zmq.PAIR) as a, Socket(zmq.PAIR) as b:
        a.bind(f"inproc://cut-short-{receive}")
        b.connect(f"inproc://cut-short-{receive}")
        await b.send(b"one")
        await _arrived(a)
        with trio.CancelScope() as scope:
            scope.cancel()  # the timeout is already due when the message is there
            await getattr(a, receive)()
        assert scope.cancelled_caught
        got = await getattr(a, receive)()
        assert got in (b"one", [b"one"])


async def test_a_send_cut_short_by_a_timeout_is_not_sent() -> None:
    """A send that raises Cancelled did not send: the caller may send it again."""
    with trio.fail_after(5), Socket(zmq.PAIR) as a, Socket(zmq.PAIR) as b:
        a.bind("inproc://send-cut-short")
        b.connect("inproc://send-cut-short")
        with trio.CancelScope() as scope:
            scope.cancel()
            await b.send(b"not sent")
        assert scope.cancelled_caught
        await b.send(b"sent")
        assert await a.recv() == b"sent"


async def test_the_nowait_forms_take_what_is_there_and_never_wait() -> None:
    """A reader takes the run of messages that queued up in one go; with none left it gets
    None at once. A ROUTER's `route_nowait` reaches a live peer and raises for a gone one."""
    with trio.fail_after(5), Socket(zmq.ROUTER) as router, Socket(zmq.DEALER) as dealer:
        address = router.bind("tcp://127.0.0.1:0")
        dealer.connect(address)
        assert router.recv_multipart_nowait() is None
        for i in range(5):
            await dealer.send(b"%d" % i)
        identity, first = await router.recv_multipart()
        rest = []
        while len(rest) < 4:
            got = router.recv_multipart_nowait()
            if got is None:  # the others are still on their way through the I/O thread
                await trio.sleep(0.01)
                continue
            rest.append(got)
        assert [first] + [payload for _, payload in rest] == [b"0", b"1", b"2", b"3", b"4"]
        assert router.recv_multipart_nowait() is None
        router.route_nowait([identity, b"back"])
        assert await dealer.recv() == b"back"
        with pytest.raises(PeerGone):
            router.route_nowait([b"nobody", b"hello"])
        with pytest.raises(TypeError):
            dealer.route_nowait([b"x"])


async def test_send_nowait_sends_when_there_is_room_and_never_waits() -> None:
    """A DEALER with no peer has nowhere to queue: `send_nowait` says so at once and sends
    nothing; once connected it sends. A ROUTER refuses it (its sends are `route_nowait`)."""
    with trio.fail_after(5), Socket(zmq.ROUTER) as router, Socket(zmq.DEALER) as dealer:
        assert dealer.send_nowait(b"too early") is False
        dealer.connect(router.bind("tcp://127.0.0.1:0"))
        while not dealer.send_nowait(b"hello"):  # the connection is being made
            await trio.sleep(0.01)
        _, payload = await router.recv_multipart()
        assert payload == b"hello"
        with pytest.raises(TypeError):
            router.send_nowait(b"x")

