"""The `vanish_stream` fault drops the stream of the connection it names, not the newest one:
a test (or the soak) that drops its own decoy must not take a bystander's stream, whichever
connected last. A name that is no live connection drops nothing and says so."""

from __future__ import annotations

import trio

from sluice.ipc import messages as m
from sluice.ipc.control import send_command

from support.raw_peer import RawPeer


def paused(rid: str) -> m.Generate:
    """A long request that stops for want of credits once it sent one chunk."""
    return m.Generate(rid, prompt="hi", credits=1,
                      sampling=m.SamplingParams(max_tokens=4000, ignore_eos=True))


async def test_vanish_drops_the_named_stream_and_spares_the_newer_one(null_daemon) -> None:
    handle = await null_daemon(debug_faults=True)
    with trio.fail_after(30), RawPeer(handle.listen) as decoy, \
            RawPeer(handle.listen) as bystander:
        await decoy.send(paused("d"))
        assert isinstance(await decoy.receive(), m.Accepted)
        await bystander.send(paused("b"))  # connects last: the newest stream
        assert isinstance(await bystander.receive(), m.Accepted)

        unknown = await send_command(handle.control,
                                     m.InjectFault("vanish_stream", target="00" * 8))
        assert not unknown.ok and "no stream" in unknown.message
        gone = await send_command(handle.control,
                                  m.InjectFault("vanish_stream", target=decoy.identity.hex()))
        assert gone.ok and gone.message.endswith(decoy.identity.hex())
        fixed = await send_command(handle.control, m.ReconcileCommand())
        assert len(fixed.findings) == 1 and decoy.identity.hex() in fixed.findings[0]

        await bystander.send(m.Credit("b", 1))  # its stream still serves it
        assert any(isinstance(msg, m.Chunk) for msg in await bystander.receive_for(0.5))
        await bystander.send(m.Cancel("b"))
        assert (await bystander.until_finished("b"))[-1].reason is m.FinishReason.CANCELLED
