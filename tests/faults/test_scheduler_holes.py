"""Holes between the scheduler and its peers: checks that raced a step in flight, and a
Cancel that crossed a Finished and then cancelled a later request reusing the id."""

from __future__ import annotations

import os

import trio
import zmq

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.codec import Codec
from sluice.ipc.control import fetch_status, send_command
from sluice.ipc.sockets import Socket


async def _keep_busy(client: AsyncClient, done: trio.Event, results: list) -> None:
    """One client's workload: a request after another until `done`."""
    while not done.is_set():
        generation = await client.generate("load", max_tokens=500)
        results.append((await generation.collect()).finish_reason)


async def test_reconcile_and_the_check_report_nothing_while_steps_run(null_daemon) -> None:
    handle = await null_daemon()
    with trio.fail_after(120):
        async with AsyncClient(handle.listen) as client:
            done, results = trio.Event(), []
            findings, errors, checked_while_running = [], [], 0
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(_keep_busy, client, done, results)
                for _ in range(25):
                    reply = await send_command(handle.control, m.ReconcileCommand())
                    findings.extend(reply.findings)
                    status = await fetch_status(handle.control, check_invariants=True)
                    errors.extend(status.invariant_errors)
                    checked_while_running += status.requests.running > 0
                done.set()
            assert findings == []
            assert errors == []
            assert checked_while_running > 0, "the checks never overlapped the workload"
            assert results and set(results) == {"length"}


class RawClient:
    """The wire protocol by hand, to choose request ids and when credits and cancels go."""

    def __init__(self, address: str):
        self.sock = Socket(zmq.DEALER)
        self.sock.zmq.setsockopt(zmq.ROUTING_ID, os.urandom(8))
        self.sock.connect(address)
        self.send_codec = Codec(m.CLIENT_MESSAGES)
        self.recv_codec = Codec(m.SERVER_MESSAGES)

    async def send(self, msg: object) -> None:
        await self.sock.send(self.send_codec.encode(msg))

    async def until_finished(self, request_id: str) -> tuple[m.Finished, list[int]]:
        tokens: list[int] = []
        while True:
            for msg in [msg for frame in await self.sock.recv_multipart()
                        for msg in self.recv_codec.decode_batch(frame)]:
                if isinstance(msg, m.Chunk) and msg.request_id == request_id:
                    tokens.extend(msg.token_ids)
                    await self.send(m.Credit(request_id, 1))
                elif isinstance(msg, m.Finished) and msg.request_id == request_id:
                    return msg, tokens

    def close(self) -> None:
        self.sock.close()


async def test_a_cancel_that_crossed_a_finished_spares_a_later_request_with_that_id(
    null_daemon,
) -> None:
    handle = await null_daemon()
    client = RawClient(handle.listen)
    try:
        with trio.fail_after(60):
            # one credit: the first chunk goes out, the rest and the Finished wait in the
            # stream while the scheduler has already ended the request
            await client.send(m.Generate("same", prompt="hi", sampling=m.SamplingParams(max_tokens=3),
                                         credits=1))
            while (await fetch_status(handle.control)).counters.finished < 1:
                await trio.sleep(0.02)
            await client.send(m.Cancel("same"))  # reaches the scheduler after the end
            await client.send(m.Credit("same", 10))
            await client.until_finished("same")
            await trio.sleep(0.2)  # the Release has reached the scheduler

            await client.send(m.Generate("same", prompt="hi again",
                                         sampling=m.SamplingParams(max_tokens=3), credits=10))
            finished, tokens = await client.until_finished("same")
            assert finished.reason == m.FinishReason.LENGTH
            assert len(tokens) == 3
    finally:
        client.close()
