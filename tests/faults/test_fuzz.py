"""Fuzzing the client socket of a live daemon (`--executor null`) through real sockets.

Frames are made by mutating valid ones (bytes flipped, cut, inserted, spliced; fields given
values of the wrong type) and at random; the client codec sorts them into malformed and
well-formed. The malformed ones (at least 100,000, some sent as multipart messages) go out
over several DEALERs that read everything: each must cost exactly one `Rejected`, or, where
the daemon could not answer, one count of its dropped-frame counter. The well-formed mutants
go out too, with their request ids made unique and their lengths kept short: each
`Generate` gets exactly one final answer, and an accepted one exactly one `Finished`. The
daemon keeps serving, answers status, holds the KV invariant and exits 0 on SIGTERM.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal

import msgpack
import trio
import zmq

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.codec import Codec, CodecError
from sluice.ipc.control import fetch_status
from sluice.ipc.sockets import Socket

MALFORMED = 50_000
DEALERS = 4
oracle = Codec(m.CLIENT_MESSAGES)
server_codec = Codec(m.SERVER_MESSAGES)

VALID = [
    m.Generate("g", prompt="The capital of France is"),
    m.Generate("c", messages=(m.ChatMessage("user", "Hi!"),), priority=3, credits=4),
    m.Generate("i", prompt_ids=(1, 504, 3458), sampling=m.SamplingParams(
        max_tokens=4, temperature=0.7, top_p=0.9, top_k=40, seed=7, stop=("\n",),
        stop_token_ids=(2,), ignore_eos=True)),
    m.Credit("g", 8), m.Cancel("c"), m.Heartbeat(3), m.Describe(),
]
RANDOM_VALUES = [None, True, -1, 0, 2**40, -2**63, 1.5, float("nan"), "", "x" * 40, b"\x00",
                 [], [1, "a"], {}, {"k": 1}]


def mutate(rng: random.Random, frames: list[bytes], plain: list[list]) -> bytes:
    kind = rng.randrange(7)
    frame = rng.choice(frames)
    if kind == 0:  # flip bytes
        data = bytearray(frame)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if kind == 1:  # cut
        return frame[:rng.randrange(len(frame))]
    if kind == 2:  # insert
        at = rng.randrange(len(frame) + 1)
        return frame[:at] + rng.randbytes(rng.randint(1, 8)) + frame[at:]
    if kind == 3:  # splice two frames
        other = rng.choice(frames)
        return frame[:rng.randrange(len(frame))] + other[rng.randrange(len(other)):]
    if kind == 4:  # random bytes
        return rng.randbytes(rng.randint(0, 64))
    envelope = [list(x) if isinstance(x, list) else x for x in rng.choice(plain)]
    body = dict(envelope[3])
    if kind == 5 and body:  # a field of the wrong type
        body[rng.choice(list(body))] = rng.choice(RANDOM_VALUES)
    else:  # a header or an unknown field gone wrong
        envelope[rng.randrange(3)] = rng.choice(RANDOM_VALUES + [rng.randrange(64)])
        body[rng.choice(["zz", "request_id", "prompt", "chunks"])] = rng.choice(RANDOM_VALUES)
    envelope[3] = body
    return msgpack.packb(envelope, use_bin_type=True)


def make_frames(seed: int) -> tuple[list[list[bytes]], list[object]]:
    """(malformed messages, each a list of frames; well-formed mutants, decoded)."""
    rng = random.Random(seed)
    frames = [oracle.encode(msg) for msg in VALID]
    plain = [msgpack.unpackb(f, raw=False) for f in frames]
    malformed: list[list[bytes]] = []
    wellformed: list[object] = []
    while len(malformed) < MALFORMED:
        if rng.random() < 0.02:  # one message of two frames: never valid
            malformed.append([rng.choice(frames), mutate(rng, frames, plain)])
            continue
        frame = mutate(rng, frames, plain)
        try:
            wellformed.append(oracle.decode(frame))
        except CodecError:
            malformed.append([frame])
    return malformed, wellformed


class Dealer:
    """One client connection that sends its share while reading everything it is sent."""

    def __init__(self, address: str):
        self.socket = Socket(zmq.DEALER)
        self.socket.zmq.setsockopt(zmq.ROUTING_ID, os.urandom(8))
        self.socket.connect(address)
        self.got: list[object] = []

    async def read(self) -> None:
        while True:
            for frame in await self.socket.recv_multipart():
                self.got.extend(server_codec.decode_batch(frame))

    async def send(self, messages: list[list[bytes]]) -> None:
        for frames in messages:
            await self.socket.send_multipart(frames)


def short(msg: object, n: int) -> object:
    """A well-formed mutant as sent: a unique id and a short generation."""
    if not isinstance(msg, m.Generate):
        return msg
    sampling = dataclasses.replace(msg.sampling, max_tokens=min(msg.sampling.max_tokens, 16))
    return dataclasses.replace(msg, request_id=f"w{n}", credits=64, sampling=sampling)


async def test_fuzzed_frames_cost_one_answer_each_and_the_daemon_keeps_serving(
        tmp_path, daemon_process, drained_and_consistent) -> None:
    process, listen, control = daemon_process(
        ["--executor", "null", "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock"], log=tmp_path / "sluiced.log")
    malformed, wellformed = await trio.to_thread.run_sync(make_frames, 20261130)
    dropped_before = (await fetch_status(control)).gateway.dropped_frames
    sent_wellformed = [short(msg, n) for n, msg in enumerate(wellformed[:3000])]
    generates = [msg for msg in sent_wellformed if isinstance(msg, m.Generate)]
    dealers = [Dealer(listen) for _ in range(DEALERS + 1)]
    checker = dealers[-1]  # sends the well-formed mutants

    def final_answers() -> dict[str, list[object]]:
        answers: dict[str, list[object]] = {}
        for msg in checker.got:
            if isinstance(msg, (m.Accepted, m.Rejected, m.Finished)):
                answers.setdefault(msg.request_id, []).append(msg)
        return answers

    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            for dealer in dealers:
                nursery.start_soon(dealer.read)
            async with trio.open_nursery() as senders:
                for i, dealer in enumerate(dealers[:DEALERS]):
                    senders.start_soon(dealer.send, malformed[i::DEALERS])
                senders.start_soon(checker.send, [[oracle.encode(msg)] for msg in sent_wellformed])
            while True:  # until every frame is accounted for (the test's timeout bounds it)
                rejected = sum(isinstance(msg, m.Rejected)
                               for dealer in dealers[:DEALERS] for msg in dealer.got)
                dropped = (await fetch_status(control)).gateway.dropped_frames - dropped_before
                answers = final_answers()
                ended = sum(isinstance(a[-1], (m.Rejected, m.Finished)) for a in answers.values())
                if rejected + dropped >= len(malformed) and ended >= len(generates):
                    break
                await trio.sleep(0.5)
            await trio.sleep(1)  # nothing more may come
            nursery.cancel_scope.cancel()
        for dealer in dealers:
            dealer.socket.close()
        rejected = sum(isinstance(msg, m.Rejected)
                       for dealer in dealers[:DEALERS] for msg in dealer.got)
        dropped = (await fetch_status(control)).gateway.dropped_frames - dropped_before
        assert rejected > 0
        assert rejected + dropped == len(malformed)

        answers = final_answers()
        assert len(answers) == len(generates)
        for msg in generates:
            kinds = [type(a) for a in answers.get(msg.request_id, [])]
            assert kinds in ([m.Rejected], [m.Accepted, m.Finished]), (msg, kinds)

        async with AsyncClient(listen) as client:
            generation = await client.generate("still serving", max_tokens=4)
            assert (await generation.collect()).finish_reason == "length"
        await drained_and_consistent(control)
        process.send_signal(signal.SIGTERM)
        assert await trio.to_thread.run_sync(process.wait) == 0
