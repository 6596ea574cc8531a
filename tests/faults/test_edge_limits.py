"""The client edge's intake limits: frame bytes, open requests per connection, credits.

- an oversize frame is refused by ZeroMQ while it arrives (`MAXMSGSIZE`), never held whole:
  the daemon's peak memory does not grow by its size, and the daemon keeps serving;
- the client library knows the limit from `ServerInfo` and refuses such a request itself;
- a connection holds at most `max_requests_per_connection` open requests;
- credits are clamped to `max_credits`: no more chunks are sent ahead than that, and the
  client library, told the clamp by `ServerInfo`, never waits on a window wider than it;
- the library grants no credit a request cannot use, and still streams every request to its
  end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import zmq

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient, Client
from sluice.ipc.vocabulary import InvalidRequestError, OverloadedError

from support.raw_peer import RawPeer

MIB = 1024 * 1024


def peak_rss(pid: int) -> int:
    """The process's peak resident memory in bytes (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def test_an_oversize_frame_is_never_buffered(tmp_path, daemon_process,
                                                   drained_and_consistent) -> None:
    process, listen, control = daemon_process(
        ["--executor", "null", "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock"])
    try:  # reset the peak so that it measures from now (Linux: "5" resets VmHWM)
        Path(f"/proc/{process.pid}/clear_refs").write_text("5")
    except OSError:
        pytest.skip("cannot reset the daemon's peak memory here")
    before = peak_rss(process.pid)
    with zmq.Context.instance().socket(zmq.DEALER) as sender:
        sender.setsockopt(zmq.LINGER, 0)
        sender.connect(listen)
        sender.send(b"\x00" * (64 * MIB))
        with trio.fail_after(30):  # the daemon drops the peer once it sees the frame's size
            async with AsyncClient(listen) as client:
                generation = await client.generate("still serving", max_tokens=3)
                assert (await generation.collect()).finish_reason == "length"
        await trio.sleep(1)  # what a daemon that reads the frame would have read by now
    assert peak_rss(process.pid) - before < 16 * MIB
    await drained_and_consistent(control)


async def test_the_client_library_refuses_an_oversize_request_itself(null_daemon) -> None:
    handle = await null_daemon(**{"limits.max_frame_bytes": 4096})
    with trio.fail_after(30):
        async with AsyncClient(handle.listen) as client:
            assert (await client.status()).max_frame_bytes == 4096
            with pytest.raises(InvalidRequestError) as refused:
                await client.generate("x" * 5000, max_tokens=2)
            assert refused.value.field == "frame"
            assert "at most 4096 bytes" in str(refused.value)
            ok = await client.generate("small enough", max_tokens=2)  # the connection lives
            assert (await ok.collect()).finish_reason == "length"

    def blocking() -> None:
        with Client(handle.listen) as client:
            with pytest.raises(InvalidRequestError, match="at most 4096 bytes"):
                client.generate("x" * 5000, max_tokens=2)
            assert client.generate("fine", max_tokens=2).collect().finish_reason == "length"

    with trio.fail_after(30):
        await trio.to_thread.run_sync(blocking)


async def test_open_requests_per_connection_are_limited(null_daemon) -> None:
    handle = await null_daemon(**{"limits.max_requests_per_connection": 4})
    with trio.fail_after(30):
        async with AsyncClient(handle.listen, credit_window=1) as client:
            # never read: each stays open, paused by backpressure
            open_ones = [await client.generate(str(i), max_tokens=500) for i in range(4)]
            with pytest.raises(OverloadedError) as refused:
                await client.generate("fifth", max_tokens=2)
            assert refused.value.field == "max_requests_per_connection"
            async with AsyncClient(handle.listen) as other:  # the limit is per connection
                assert (await (await other.generate("x", max_tokens=2)).collect()).token_ids
            await open_ones[0].cancel()
            assert (await open_ones[0].collect()).finish_reason == "cancelled"
            fifth = await client.generate("fifth again", max_tokens=2)
            assert (await fifth.collect()).finish_reason == "length"
            for generation in open_ones[1:]:
                await generation.cancel()
                await generation.collect()


async def test_credits_are_clamped(null_daemon) -> None:
    handle = await null_daemon(**{"limits.max_credits": 3})
    with trio.fail_after(30), RawPeer(handle.listen) as peer:
        await peer.send(m.Generate("r", prompt="hi", credits=1_000_000,
                                   sampling=m.SamplingParams(max_tokens=200, ignore_eos=True)))
        sent_ahead = await peer.receive_for(1.0)
        chunks = [msg for msg in sent_ahead if isinstance(msg, m.Chunk)]
        assert isinstance(sent_ahead[0], m.Accepted)
        assert len(chunks) == 3  # not 200: the grant was clamped
        assert not any(isinstance(msg, m.Finished) for msg in sent_ahead)
        await peer.send(m.Credit("r", 1_000_000))
        more = [msg for msg in await peer.receive_for(1.0) if isinstance(msg, m.Chunk)]
        assert len(more) == 3
        await peer.send(m.Cancel("r"))
        assert (await peer.until_finished("r"))[-1].reason is m.FinishReason.CANCELLED


async def test_a_window_wider_than_the_clamp_still_streams_to_the_end(null_daemon) -> None:
    # the library tops up after half its window; with the window clamped below that half,
    # no top-up would ever be sent unless the library opens only the window the daemon allows
    handle = await null_daemon(**{"limits.max_credits": 3})
    with trio.fail_after(30):
        async with AsyncClient(handle.listen, credit_window=64) as client:
            assert (await client.status()).max_credits == 3
            generations = [await client.generate(str(i), max_tokens=40, ignore_eos=True)
                           for i in range(4)]
            for generation in generations:
                result = await generation.collect()
                assert (len(result.token_ids), result.finish_reason) == (40, "length")

    def blocking() -> None:
        with Client(handle.listen, credit_window=64) as client:
            result = client.generate("sync", max_tokens=40, ignore_eos=True).collect()
            assert (len(result.token_ids), result.finish_reason) == (40, "length")

    with trio.fail_after(30):
        await trio.to_thread.run_sync(blocking)


async def test_the_library_grants_only_credits_a_request_can_use(null_daemon) -> None:
    handle = await null_daemon()
    with trio.fail_after(30):
        async with AsyncClient(handle.listen, credit_window=4) as client:
            granted: list[int] = []
            send = client._send

            async def spy(msg) -> None:
                if isinstance(msg, m.Credit):
                    granted.append(msg.chunks)
                await send(msg)

            client._send = spy
            # (max_tokens, stop strings, credits the request can use beyond its window of 4)
            for max_tokens, stop, usable in ((4, (), 0), (3, (), 0), (4, ("never said",), 1),
                                             (10, (), 6), (10, ("never said",), 7)):
                granted.clear()
                result = await (await client.generate(
                    "x", max_tokens=max_tokens, ignore_eos=True, stop=stop)).collect()
                assert (len(result.token_ids), result.finish_reason) == (max_tokens, "length")
                assert sum(granted) <= usable, (max_tokens, stop, granted)
                if usable >= 2:  # half a window was taken before the end: it was given back
                    assert granted, (max_tokens, stop)


def test_no_credit_at_all_is_refused_as_a_setting() -> None:
    from sluice.actors.front.limits import Limits

    with pytest.raises(ValueError, match="max_credits: must be at least 1"):
        Limits(max_credits=0)
