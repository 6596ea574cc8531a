"""Connections are the client's: a cap on how many, and a connection's faults stay its own.

- past the connection cap a new peer gets `Rejected(overloaded)` and no actor, and the
  connections already open keep being served;
- a Stream that crashes again and again ends only its own connection's requests, is never
  counted toward the daemon's escalation, and leaves no supervision bookkeeping behind;
- a closed Stream never takes work: what was routed to it before the gateway learnt of the
  close is refused, and the connection's next request opens a fresh stream and is served.

The null_daemon fixture checks the KV invariant when each test ends.
"""

from __future__ import annotations

import pytest
import trio

from sluice.actors.runtime import messages as am
from sluice.actors.front.stream import Stream
from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status
from sluice.ipc.vocabulary import OverloadedError

from support.raw_peer import RawPeer


async def test_connections_over_the_cap_are_refused_without_an_actor(null_daemon) -> None:
    handle = await null_daemon(**{"limits.max_connections": 3})
    gateway = handle.daemon.gateway
    with trio.fail_after(60):
        async with AsyncClient(handle.listen) as a, AsyncClient(handle.listen) as b, \
                AsyncClient(handle.listen) as c:
            for client in (a, b, c):
                assert (await (await client.generate("hi", max_tokens=2)).collect()).token_ids
            async with AsyncClient(handle.listen) as d:
                with pytest.raises(OverloadedError) as refused:
                    await d.generate("one too many", max_tokens=2)
                assert refused.value.field == "connections"
                assert len(gateway.streams) == 3  # no actor was made for the fourth
            for client in (a, b, c):  # the others keep being served
                assert (await (await client.generate("again", max_tokens=3)).collect()).token_ids
            report = await fetch_status(handle.control)
            assert report.connections == 3
            assert report.gateway.refused_connections >= 1


async def test_a_stream_that_keeps_crashing_ends_only_its_connection(null_daemon,
                                                                     monkeypatch) -> None:
    handle = await null_daemon()
    daemon = handle.daemon
    budget = daemon.supervisor.policy.max_restarts

    async def crash(self, msg):
        raise RuntimeError("injected stream fault")

    monkeypatch.setattr(Stream, "on_cancel", crash)  # every Cancel crashes its stream
    with trio.fail_after(120):
        async with AsyncClient(handle.listen, credit_window=1) as victim, \
                AsyncClient(handle.listen, credit_window=1) as bystander:
            running = await bystander.generate("keeps going", max_tokens=400)
            for _ in range(budget * 2):  # twice the budget that escalates a daemon actor
                while True:
                    try:  # a request may reach the crashed stream before the gateway
                        doomed = await victim.generate("x", max_tokens=1000)  # forgot it
                        break
                    except OverloadedError as exc:
                        assert exc.field == "connection"
                        await trio.sleep(0.05)
                async for _ in doomed:
                    break
                await doomed.cancel()
                assert (await doomed.collect()).finish_reason == "error"
            assert (await running.collect()).finish_reason == "length"
            assert len(running.result.token_ids) == 400
            assert not any(name.startswith("stream-") for name in daemon.supervisor.restarts)
            assert len(daemon.gateway.streams) <= 2
            monkeypatch.undo()
            later = await victim.generate("served again", max_tokens=4)
            assert (await later.collect()).finish_reason == "length"


async def test_a_closed_stream_refuses_what_was_routed_to_it(null_daemon) -> None:
    handle = await null_daemon()
    gateway = handle.daemon.gateway
    with trio.fail_after(30), RawPeer(handle.listen) as peer:
        await peer.send(m.Generate("first", prompt="hi", sampling=m.SamplingParams(max_tokens=2)))
        assert isinstance((await peer.until_finished("first"))[-1], m.Finished)
        stream = gateway.streams[peer.identity]
        # what the gateway does when the peer is unreachable, then a Generate it routes to
        # the same stream before it has learnt that the stream closed
        stream.inbox.put(am.ClientGone(peer.identity))
        stream.inbox.put(m.Generate("raced", prompt="hi", sampling=m.SamplingParams(max_tokens=2)))
        refused = await peer.receive()
        assert isinstance(refused, m.Rejected) and refused.request_id == "raced"
        assert refused.code is m.RejectCode.OVERLOADED and refused.field == "connection"
        while peer.identity in gateway.streams:
            await trio.sleep(0.01)
        # the same connection id again: a fresh stream serves it
        await peer.send(m.Generate("again", prompt="hi", sampling=m.SamplingParams(max_tokens=3)))
        answers = await peer.until_finished("again")
        assert isinstance(answers[0], m.Accepted)
        assert answers[-1].reason is m.FinishReason.LENGTH
        assert sum(len(a.token_ids) for a in answers if isinstance(a, m.Chunk)) == 3


async def test_a_peer_reconnecting_under_a_closed_streams_id_is_served(null_daemon) -> None:
    handle = await null_daemon(**{"stream.heartbeat_timeout": 0.5,
                                  "stream.heartbeat_interval": 0.1})
    gateway = handle.daemon.gateway
    identity = b"same-id-twice"
    with trio.fail_after(30):
        with RawPeer(handle.listen, identity) as first:
            await first.send(m.Generate("a", prompt="hi", sampling=m.SamplingParams(max_tokens=2)))
            assert isinstance((await first.until_finished("a"))[-1], m.Finished)
        while identity in gateway.streams:  # silent: its stream closes by heartbeat timeout
            await trio.sleep(0.05)
        with RawPeer(handle.listen, identity) as second:
            await second.send(m.Generate("a", prompt="hi", sampling=m.SamplingParams(max_tokens=2)))
            answers = await second.until_finished("a")
            assert isinstance(answers[0], m.Accepted)
            assert answers[-1].reason is m.FinishReason.LENGTH
