"""A ROUTER send to a peer that cannot take more fails at once: it never waits, never spins.

A ROUTER is writable while any peer has room, so waiting for room after one peer's queue
filled returned at once and the retry spun without yielding. Here one peer never reads and
another reads everything: the send to the first raises `PeerFull`, the second is served.
"""

from __future__ import annotations

import pytest
import trio
import zmq

from sluice.ipc.sockets import PeerFull, PeerGone, Socket

# the old send path spun without yielding, where trio cannot time out: pytest-timeout can
pytestmark = pytest.mark.timeout(60)


async def test_a_full_peer_raises_at_once_and_the_others_are_served() -> None:
    with trio.fail_after(20), Socket(zmq.ROUTER) as router, \
            Socket(zmq.DEALER) as stuck, Socket(zmq.DEALER) as reader:
        router.zmq.setsockopt(zmq.SNDHWM, 4)
        address = router.bind("tcp://127.0.0.1:0")
        stuck.zmq.setsockopt(zmq.RCVHWM, 1)
        stuck.zmq.setsockopt(zmq.RCVBUF, 4096)
        for peer, name in ((stuck, b"stuck"), (reader, b"reader")):
            peer.zmq.setsockopt(zmq.ROUTING_ID, name)
            peer.connect(address)
            await peer.send(b"hello")
            assert await router.recv_multipart() == [name, b"hello"]
        payload = b"x" * 4096
        with pytest.raises(PeerFull) as full:
            for _ in range(100_000):  # far more than the queues and socket buffers hold
                await router.send_multipart([b"stuck", payload])
        assert isinstance(full.value, PeerGone)  # callers that only know "gone" drop it too
        await router.send_multipart([b"reader", b"still served"])
        assert await reader.recv() == b"still served"
        with pytest.raises(PeerGone):
            await router.send_multipart([b"nobody", b"?"])
