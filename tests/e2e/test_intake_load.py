"""Intake under load, through a live daemon on the null executor: a burst of big prompts is
bounded by `max_pending_prompt_bytes` and never stalls other requests' decoding; long
client-chosen ids never reach the logs whole. The `null_daemon` fixture checks the KV
invariant after each test.
"""

from __future__ import annotations

import threading

import structlog
import trio
import zmq

from sluice.actors.text.actor import LONG_PROMPT_BYTES, TOKENIZER_THREADS
from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.codec import Codec
from sluice.ipc.sockets import Socket

client_codec = Codec(m.CLIENT_MESSAGES)
server_codec = Codec(m.SERVER_MESSAGES)
BIG = 64 * 1024  # bytes of one prompt of the burst
BIG_PROMPT = ("the quick brown fox jumps over the lazy dog " * (BIG // 40))[:BIG]


class GatedTokenizer:
    """The real tokenizer, except that a long text waits at a gate before it is encoded.

    A named test double around the real part: while the gate is shut, the burst's prompts
    are certainly still being tokenized, so what the daemon does meanwhile can be seen.
    """

    def __init__(self, inner):
        self._inner = inner
        self.gate = threading.Event()
        self.inside = 0  # threads waiting at the gate now
        self.most_inside = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def encode(self, text: str) -> list[int]:
        if len(text) > LONG_PROMPT_BYTES:
            with self._lock:
                self.inside += 1
                self.most_inside = max(self.most_inside, self.inside)
            try:
                self.gate.wait(timeout=60)
            finally:
                with self._lock:
                    self.inside -= 1
        return self._inner.encode(text)


async def read_until(sock: Socket, ended: dict[str, object], count: int) -> None:
    while len(ended) < count:
        for msg in server_codec.decode_batch(await sock.recv()):
            if isinstance(msg, (m.Rejected, m.Finished)):
                ended[msg.request_id] = msg


async def test_a_burst_of_big_prompts_is_bounded_and_decoding_goes_on(null_daemon) -> None:
    fit = 3  # prompts whose bytes fit the limit exactly: at the limit is still accepted
    handle = await null_daemon(**{"limits.max_pending_prompt_bytes": fit * BIG,
                                  "null.max_model_len": 32768})
    gated = GatedTokenizer(handle.daemon.tokenizer.tokenizer)
    handle.daemon.tokenizer.tokenizer = gated
    burst = [m.Generate(f"big-{i}", prompt=BIG_PROMPT, sampling=m.SamplingParams(max_tokens=2))
             for i in range(8)]
    ended: dict[str, object] = {}
    try:
        with trio.fail_after(60), Socket(zmq.DEALER) as sock:
            sock.connect(handle.listen)
            async with AsyncClient(handle.listen, credit_window=4) as client:
                running = await client.generate("hi", max_tokens=300, temperature=0)
                for request in burst:
                    await sock.send(client_codec.encode(request))
                # the prompts past the limit are refused at once, while the others wait
                await read_until(sock, ended, len(burst) - fit)
                refused = sorted(ended)
                assert refused == [f"big-{i}" for i in range(fit, len(burst))]
                for rid in refused:
                    assert ended[rid].code is m.RejectCode.OVERLOADED
                    assert ended[rid].field == "prompt"
                    assert "limits.max_pending_prompt_bytes" in ended[rid].message
                while gated.inside < TOKENIZER_THREADS:
                    await trio.sleep(0.01)
                # another connection's request decodes to the end while the burst is held
                done = await running.collect()
                assert done.finish_reason == "length" and len(done.token_ids) == 300
                assert gated.inside == TOKENIZER_THREADS  # still held: nothing was let through
                gated.gate.set()
                await read_until(sock, ended, len(burst))
            for rid in (f"big-{i}" for i in range(fit)):
                assert isinstance(ended[rid], m.Finished), ended[rid]
                assert ended[rid].usage.prompt_tokens > 1000
            assert gated.most_inside == TOKENIZER_THREADS  # tokenizing at once is bounded
            # their bytes were given back: as many big prompts fit again
            again: dict[str, object] = {}
            for i in range(fit):
                await sock.send(client_codec.encode(m.Generate(
                    f"again-{i}", prompt=BIG_PROMPT, sampling=m.SamplingParams(max_tokens=2))))
            await read_until(sock, again, fit)
            assert all(isinstance(outcome, m.Finished) for outcome in again.values()), again
    finally:
        gated.gate.set()


async def test_a_long_request_id_never_reaches_the_logs_whole(null_daemon) -> None:
    handle = await null_daemon(**{"limits.max_request_id_chars": 20_000})
    long_id = "".join(f"{i:05d}" for i in range(2000))  # 10 kB, no repeated stretch
    crash_id = long_id[::-1]
    handle.daemon.tokenizer.tokenizer = FailsOnBoom(handle.daemon.tokenizer.tokenizer)
    requests = [m.Generate(long_id, prompt="hi", sampling=m.SamplingParams(max_tokens=3)),
                m.Generate(crash_id, prompt="boom", sampling=m.SamplingParams(max_tokens=3))]
    ended: dict[str, object] = {}
    with structlog.testing.capture_logs() as logs, trio.fail_after(30):
        with Socket(zmq.DEALER) as sock:
            sock.connect(handle.listen)
            for request in requests:
                await sock.send(client_codec.encode(request))
            await read_until(sock, ended, len(requests))
        # the Usage actor logs a request's end after its client was told
        while not any(event["event"] == "request ended" for event in logs):
            await trio.sleep(0.01)
    assert ended[long_id].reason is m.FinishReason.LENGTH  # the client still gets its id back
    assert ended[crash_id].reason is m.FinishReason.ERROR
    events = {event["event"] for event in logs}
    assert {"request ended", "request failed in the tokenizer"} <= events
    lines = [repr(event) for event in logs]
    assert not [line for line in lines if long_id in line or crash_id in line]
    assert [line for line in lines if long_id[:40] in line]  # named, cut short


class FailsOnBoom:
    """The real tokenizer, except that encoding "boom" raises (a failure to be logged)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def encode(self, text: str) -> list[int]:
        if text == "boom":
            raise RuntimeError("injected tokenizer fault")
        return self._inner.encode(text)


class FailsOnLongBoom(GatedTokenizer):
    """The gated tokenizer, except that a long text starting with "boom" raises once let in."""

    def encode(self, text: str) -> list[int]:
        if text.startswith("boom"):
            super().encode("")  # just count it in
            self.gate.wait(timeout=60)
            raise RuntimeError("injected tokenizer fault")
        return super().encode(text)


async def test_a_crash_while_tokenizing_a_long_prompt_fails_only_that_request(null_daemon) -> None:
    handle = await null_daemon(**{"null.max_model_len": 32768})
    daemon = handle.daemon
    faulty = FailsOnLongBoom(daemon.tokenizer.tokenizer)
    daemon.tokenizer.tokenizer = faulty
    # one thread: the crash then surely finds long prompts still waiting for their turn
    daemon.tokenizer.thread_slots.total_tokens = 1
    results = {}

    async def ask(client: AsyncClient, name: str, prompt: str) -> None:
        results[name] = await (await client.generate(prompt, max_tokens=2)).collect()

    try:
        with trio.fail_after(60):
            async with AsyncClient(handle.listen, credit_window=4) as client:
                running = await client.generate("hi", max_tokens=200, temperature=0)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ask, client, "boom", "boom" + BIG_PROMPT)
                    while len(daemon.tokenizer.tokenizing) < 1:
                        await trio.sleep(0.01)
                    nursery.start_soon(ask, client, "fine-a", BIG_PROMPT)
                    nursery.start_soon(ask, client, "fine-b", BIG_PROMPT)
                    while len(daemon.tokenizer.tokenizing) < 3:
                        await trio.sleep(0.01)
                    faulty.gate.set()
                assert results["boom"].finish_reason == "error"
                assert "tokenizer failed" in results["boom"].error
                # the prompts waiting behind it did nothing wrong: tokenized all the same
                for name in ("fine-a", "fine-b"):
                    assert results[name].finish_reason == "length"
                    assert results[name].usage.prompt_tokens > 1000
                assert (await running.collect()).finish_reason == "length"
                # the failure was that request's own: nothing restarted
                assert "tokenizer" not in daemon.supervisor.restarts
                assert daemon.tokenizer.pending_prompt_bytes == 0
    finally:
        faulty.gate.set()
