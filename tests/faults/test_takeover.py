"""Nobody takes over another client's connection by choosing its routing id.

Without CURVE the ROUTER never hands a routing id in use over to a newcomer (no
`ROUTER_HANDOVER`): the newcomer's frames go nowhere and the first client keeps its stream.
With CURVE a connection's Stream is bound to the client key that opened it: a frame for that
routing id under another key is refused and ends the old stream (its client must be gone, as
ZeroMQ refuses a duplicate id while it is connected); the newcomer then gets its own stream.
"""

from __future__ import annotations

import trio
import zmq

from sluice.daemon.config import AuthSettings
from sluice.ipc import messages as m

from support.raw_peer import RawPeer


def paused(rid: str) -> m.Generate:
    """A long request that stops for want of credits once it sent one chunk."""
    return m.Generate(rid, prompt="hi", credits=1,
                      sampling=m.SamplingParams(max_tokens=4000, ignore_eos=True))


async def test_without_curve_a_routing_id_in_use_is_not_handed_over(null_daemon) -> None:
    handle = await null_daemon()
    with trio.fail_after(30), RawPeer(handle.listen, b"victim") as victim:
        await victim.send(paused("v"))
        assert isinstance(await victim.receive(), m.Accepted)
        with RawPeer(handle.listen, b"victim") as intruder:
            await intruder.send(m.Describe())
            await intruder.send(m.Cancel("v"))
            assert await intruder.receive_for(1.0) == []
        await victim.send(m.Credit("v", 1))
        assert any(isinstance(msg, m.Chunk) for msg in await victim.receive_for(0.5))
        await victim.send(m.Cancel("v"))
        assert (await victim.until_finished("v"))[-1].reason is m.FinishReason.CANCELLED


async def connect_once_the_id_is_free(address: str, identity: bytes, curve) -> RawPeer:
    """A connection under `identity`, made once ZeroMQ noticed that its holder left (until
    then it leaves a newcomer with that id unidentified, for good: so connect anew)."""
    while True:
        peer = RawPeer(address, identity, curve=curve)
        await peer.send(m.Describe())
        if any(isinstance(a, m.ServerInfo) for a in await peer.receive_for(0.3)):
            return peer
        peer.socket.close()


async def test_with_curve_a_stream_is_bound_to_its_key(null_daemon) -> None:
    server_public, server_secret = zmq.curve_keypair()
    first, second = zmq.curve_keypair(), zmq.curve_keypair()
    auth = AuthSettings(server_secret_key=server_secret.decode(),
                        tenants={"a": [first[0].decode()], "b": [second[0].decode()]})
    # the daemon's heartbeats would find the owner gone within a second and end its stream
    # before anyone could reuse its id: slow them down to hold that window open
    handle = await null_daemon(auth=auth, **{"stream.heartbeat_timeout": 60.0,
                                             "stream.heartbeat_interval": 30.0})
    gateway = handle.daemon.gateway
    identity = b"shared-id"
    with trio.fail_after(30):
        with RawPeer(handle.listen, identity, curve=(server_public, *first)) as owner:
            await owner.send(paused("mine"))
            assert isinstance(await owner.receive(), m.Accepted)
            # its one chunk taken, the request waits for credits: nothing more is sent to this
            # id (a send after the owner left would end the stream before the newcomer came)
            assert isinstance(await owner.receive(), m.Chunk)
        # the owner left; its stream lives on until its heartbeat timeout
        old_stream = gateway.streams[identity]
        newcomer = await connect_once_the_id_is_free(handle.listen, identity,
                                                     (server_public, *second))
        with newcomer:
            await newcomer.send(m.Cancel("mine"))
            await newcomer.send(m.Generate("theirs", prompt="hi",
                                           sampling=m.SamplingParams(max_tokens=2)))
            answers = [a for a in await newcomer.until_finished("mine")
                       if getattr(a, "request_id", "") == "mine"]
            assert [type(a) for a in answers] == [m.Rejected]  # nothing of the owner's
            assert answers[0].code is m.RejectCode.UNAUTHORIZED
            assert answers[0].field == "connection"
            # refused while the old stream still closes, or served on the newcomer's own
            # stream once it closed: which one depends on how fast the old stream ended
            theirs = await newcomer.until_finished("theirs")
            if isinstance(theirs[-1], m.Rejected):
                assert theirs[-1].code is m.RejectCode.UNAUTHORIZED
            else:
                assert isinstance(theirs[0], m.Accepted)
                assert theirs[-1].reason is m.FinishReason.LENGTH
            while gateway.streams.get(identity) is old_stream:  # it ended, its request released
                await trio.sleep(0.01)
            await newcomer.send(m.Generate("again", prompt="hi", sampling=m.SamplingParams(max_tokens=2)))
            answers = await newcomer.until_finished("again")
            assert isinstance(answers[0], m.Accepted)
            assert answers[-1].reason is m.FinishReason.LENGTH
            assert not any(getattr(a, "request_id", "") == "mine" for a in answers)
