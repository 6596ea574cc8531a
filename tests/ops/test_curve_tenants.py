"""CURVE on the client socket: no server key or an unknown client key gets no service, a known
key's requests run under its tenant whatever they claim, and its limits yield Rejected(quota).
The client library connects with keys too."""

from __future__ import annotations

import os

import pytest
import trio
import zmq

from sluice.daemon.config import AuthSettings
from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.codec import Codec
from sluice.ipc.errors import DaemonGone
from sluice.ipc.control import send_command
from sluice.ipc.sockets import Socket

pytestmark = pytest.mark.timeout(240)  # a hang fails this test instead of the suite

_codec = Codec(m.SERVER_MESSAGES)


class RawClient:
    """A DEALER speaking the wire protocol, with CURVE keys when given."""

    def __init__(self, address: str, server_public: bytes | None = None,
                 keypair: tuple[bytes, bytes] | None = None):
        self.sock = Socket(zmq.DEALER)
        self.sock.zmq.setsockopt(zmq.ROUTING_ID, os.urandom(8))
        if server_public is not None:
            public, secret = keypair
            self.sock.zmq.curve_serverkey = server_public
            self.sock.zmq.curve_publickey = public
            self.sock.zmq.curve_secretkey = secret
        self.sock.connect(address)

    async def send(self, msg) -> None:
        await self.sock.send(_codec.encode(msg))

    async def receive(self, timeout: float) -> list:
        with trio.move_on_after(timeout):
            return _codec.decode_batch(await self.sock.recv())
        return []

    async def until(self, kind: type, request_id: str, timeout: float = 10.0):
        with trio.fail_after(timeout):
            while True:
                for msg in await self.receive(timeout):
                    if isinstance(msg, kind) and msg.request_id == request_id:
                        return msg

    def close(self) -> None:
        self.sock.close()


def generate(rid: str, max_tokens: int = 4) -> m.Generate:
    return m.Generate(rid, prompt="hello", tenant="someone-else", credits=100000,
                      sampling=m.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def test_curve_keys_decide_service_and_tenant(null_daemon) -> None:
    server_public, server_secret = zmq.curve_keypair()
    known, unknown = zmq.curve_keypair(), zmq.curve_keypair()
    auth = AuthSettings(server_secret_key=server_secret.decode(),
                        tenants={"chat": [known[0].decode()]})
    handle = await null_daemon(auth=auth,
                               scheduler={"tenants": {"chat": {"max_running": 1,
                                                               "max_queued": 1}}})
    strangers = [RawClient(handle.listen), RawClient(handle.listen, server_public, unknown)]
    for stranger in strangers:
        # a DEALER whose handshakes keep failing may have no pipe to queue into: its send
        # can wait for good, which is the point, so it is given a moment and no more
        with trio.move_on_after(1.0):
            await stranger.send(m.Describe())
            await stranger.send(generate("x"))
    assert [await s.receive(timeout=1.0) for s in strangers] == [[], []]

    client = RawClient(handle.listen, server_public, known)
    try:
        await client.send(generate("a", max_tokens=4))
        assert (await client.until(m.Finished, "a")).reason == m.FinishReason.LENGTH
        for rid in ("long-1", "long-2", "over"):
            await client.send(generate(rid, max_tokens=4000))
        refused = await client.until(m.Rejected, "over")
        assert refused.code == m.RejectCode.QUOTA
        snap = await send_command(handle.control, m.Subscribe(ttl=0.5))
        assert {r.tenant for r in snap.detail.requests} == {"chat"}
        assert snap.detail.tenants["chat"].totals.finished >= 1
        assert "someone-else" not in snap.detail.tenants
        for rid in ("long-1", "long-2"):
            await client.send(m.Cancel(rid))
            await client.until(m.Finished, rid)
    finally:
        client.close()
        for stranger in strangers:
            stranger.close()


async def test_the_client_library_speaks_curve(null_daemon) -> None:
    server_public, server_secret = zmq.curve_keypair()
    public, secret = zmq.curve_keypair()
    auth = AuthSettings(server_secret_key=server_secret.decode(),
                        tenants={"chat": [public.decode()]})
    handle = await null_daemon(auth=auth)
    with pytest.raises(ValueError, match="both curve_server_key and curve_keypair"):
        AsyncClient(handle.listen, curve_server_key=server_public)
    with pytest.raises(ValueError, match="curve_keypair\\[1\\]: a CURVE key is 40 characters"):
        AsyncClient(handle.listen, curve_server_key=server_public, curve_keypair=(public, "x"))
    with trio.fail_after(30):
        async with AsyncClient(handle.listen, curve_server_key=server_public.decode(),
                               curve_keypair=(public.decode(), secret.decode())) as client:
            result = await (await client.generate("hello", max_tokens=3,
                                                  ignore_eos=True)).collect()
    assert result.finish_reason == "length" and len(result.token_ids) == 3
    snap = await send_command(handle.control, m.Subscribe(ttl=0.5))
    assert snap.detail.tenants["chat"].totals.finished == 1
    # keys the daemon does not take get a clear error in daemon_timeout, not a wait for good
    stranger = zmq.curve_keypair()
    for server_key, keypair in ((server_public, stranger), (stranger[0], (public, secret))):
        with trio.fail_after(10):
            async with AsyncClient(handle.listen, curve_server_key=server_key,
                                   curve_keypair=keypair, daemon_timeout=1.0) as client:
                with pytest.raises(DaemonGone, match="are the CURVE keys the daemon's"):
                    await client.generate("hello", max_tokens=3)
