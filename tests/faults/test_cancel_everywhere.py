"""A cancel, at every stage a request can be in, ends it exactly once and frees its KV.

Each test drives an in-process daemon on the null executor through a raw socket, so a
`Generate` and its `Cancel` can leave back to back with no wait, and cancels many requests at
one stage: before tokenizing, while a long prompt is on a tokenizer thread or waiting for one,
queued behind a full batch, in the middle of a chunked prefill, decoding, and paused for lack
of credits. Every request asks for far more tokens than it can make before its cancel lands,
so each must end with exactly one terminal message, `Finished(cancelled)`, and the daemon
must then hold no request and no block (the KV invariant, checked here and again by the
`null_daemon` fixture).
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from contextlib import asynccontextmanager

import trio

from support.daemon import assert_drained_and_consistent
from support.raw_peer import RawPeer
from sluice.actors.text.actor import LONG_PROMPT_BYTES, TOKENIZER_THREADS
from sluice.ipc import messages as m
from sluice.ipc.control import fetch_status, send_command

CONTEXT = 65536  # the null model's context: a request may run for tens of thousands of steps
MANY = CONTEXT - 1024  # max_tokens: no request here can finish by length before its cancel
BIG = 16 * 1024  # bytes of a long prompt: tokenized on a worker thread
BIG_PROMPT = ("the quick brown fox jumps over the lazy dog " * (BIG // 40))[:BIG]
assert BIG > LONG_PROMPT_BYTES


class Ledger:
    """What one raw connection received, by request id."""

    def __init__(self, peer: RawPeer):
        self.peer = peer
        self.accepted: set[str] = set()
        self.chunks: Counter[str] = Counter()
        self.ends: defaultdict[str, list] = defaultdict(list)  # Finished and Rejected

    async def read(self) -> None:
        while True:
            msg = await self.peer.receive()
            if isinstance(msg, m.Accepted):
                self.accepted.add(msg.request_id)
            elif isinstance(msg, m.Chunk):
                self.chunks[msg.request_id] += 1
            elif isinstance(msg, (m.Finished, m.Rejected)):
                self.ends[msg.request_id].append(msg)

    async def until(self, condition) -> None:
        while not condition():
            await trio.sleep(0.01)

    async def until_ended(self, rids) -> None:
        await self.until(lambda: all(self.ends[rid] for rid in rids))

    async def settle(self) -> None:
        """Wait for a last request to end: whatever the connection would still have been
        sent about the earlier ones came first."""
        rid = f"sentinel-{len(self.ends)}"
        await self.peer.send(m.Generate(rid, prompt="hi", sampling=m.SamplingParams(max_tokens=1)))
        await self.until_ended([rid])

    def assert_cancelled_once(self, rids) -> None:
        for rid in rids:
            ends = self.ends[rid]
            assert len(ends) == 1, (rid, ends)
            assert isinstance(ends[0], m.Finished), (rid, ends)
            assert ends[0].reason is m.FinishReason.CANCELLED, (rid, ends)


def generate(rid: str, *, credits: int = 16, **prompt) -> m.Generate:
    if not prompt:
        prompt = {"prompt": f"tell me about {rid}"}
    return m.Generate(rid, sampling=m.SamplingParams(max_tokens=MANY), credits=credits, **prompt)


async def statuses(control: str, condition) -> m.StatusReport:
    while True:
        report = await fetch_status(control)
        if condition(report.requests):
            return report
        await trio.sleep(0.01)


async def start(null_daemon, **overrides):
    return await null_daemon(**{"null.max_model_len": CONTEXT, **overrides})


@asynccontextmanager
async def connected(handle, timeout: float = 120):
    """A raw connection to the daemon and the ledger of what it receives, kept by a reader."""
    with trio.fail_after(timeout), RawPeer(handle.listen) as peer:
        ledger = Ledger(peer)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ledger.read)
            yield ledger
            nursery.cancel_scope.cancel()


async def test_cancel_right_behind_generate_before_tokenizing(null_daemon) -> None:
    """Generate and Cancel leave together: the cancel reaches the daemon while the request is
    not tokenized yet (short prompts, token ids, long prompts bound for a thread)."""
    handle = await start(null_daemon)
    async with connected(handle) as ledger:
        peer = ledger.peer
        rids = []
        for i in range(60):
            rid = f"r{i}"
            kind = i % 3
            request = (generate(rid) if kind == 0
                       else generate(rid, prompt_ids=tuple(range(100 + i, 140 + i))) if kind == 1
                       else generate(rid, prompt=BIG_PROMPT))
            await peer.send(request)
            await peer.send(m.Cancel(rid))
            rids.append(rid)
        await ledger.until_ended(rids)
        await ledger.settle()
        ledger.assert_cancelled_once(rids)
        await assert_drained_and_consistent(handle.control)


class GatedTokenizer:
    """The real tokenizer, except that a long text waits at a gate before it is encoded, so
    a long prompt is surely still on its thread (or waiting for one) when it is cancelled."""

    def __init__(self, inner):
        self._inner = inner
        self.gate = threading.Event()
        self.inside = 0  # threads waiting at the gate now
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def encode(self, text: str) -> list[int]:
        if len(text) > LONG_PROMPT_BYTES:
            with self._lock:
                self.inside += 1
            try:
                self.gate.wait(timeout=60)
            finally:
                with self._lock:
                    self.inside -= 1
        return self._inner.encode(text)


async def test_cancel_while_tokenizing_ends_the_request_and_frees_its_bytes(
    null_daemon,
) -> None:
    held = 6  # long prompts whose bytes fill the budget exactly
    handle = await start(null_daemon, **{"limits.max_pending_prompt_bytes": held * BIG})
    tokenizer = handle.daemon.tokenizer
    gated = GatedTokenizer(tokenizer.tokenizer)
    tokenizer.tokenizer = gated
    cancelled: list[str] = []
    try:
        async with connected(handle) as ledger:
            peer = ledger.peer
            for round_ in range(4):
                rids = [f"long-{round_}-{i}" for i in range(held)]
                for rid in rids:
                    await peer.send(generate(rid, prompt=BIG_PROMPT))
                # round 0: two on threads, the rest waiting for one; later rounds: all waiting,
                # the threads still held by the cancelled prompts of round 0
                await ledger.until(lambda: len(tokenizer.tokenizing) == held
                                   and gated.inside == TOKENIZER_THREADS)
                for rid in rids:
                    await peer.send(m.Cancel(rid))
                await ledger.until_ended(rids)
                # ended while the gate is shut: nothing waited for the threads; and the budget
                # is free again, or the next round's prompts would be refused
                assert gated.inside == TOKENIZER_THREADS
                ledger.assert_cancelled_once(rids)
                cancelled += rids
            gated.gate.set()
            done = [f"after-{i}" for i in range(held)]
            for rid in done:
                await peer.send(m.Generate(rid, prompt=BIG_PROMPT,
                                           sampling=m.SamplingParams(max_tokens=2)))
            await ledger.until_ended(done)
            assert all(ledger.ends[rid][0].reason is m.FinishReason.LENGTH for rid in done)
            await ledger.settle()
            # the cancelled prompts' tokenizing, finished after the gate opened, was dropped
            ledger.assert_cancelled_once(cancelled)
            assert not ledger.accepted & set(cancelled)
            await assert_drained_and_consistent(handle.control)
            assert tokenizer.pending_prompt_bytes == 0
    finally:
        gated.gate.set()


async def test_an_operator_cancels_a_request_while_it_is_tokenized(null_daemon) -> None:
    """`sluice cancel` takes the route requests take: one still on a tokenizer thread ends
    there (it is not "unknown" to the scheduler), and one already admitted is still found."""
    handle = await start(null_daemon)
    tokenizer = handle.daemon.tokenizer
    gated = GatedTokenizer(tokenizer.tokenizer)
    tokenizer.tokenizer = gated
    try:
        async with connected(handle) as ledger:
            await ledger.peer.send(generate("long", prompt=BIG_PROMPT))
            await ledger.peer.send(generate("short", credits=1))
            await ledger.until(lambda: len(tokenizer.tokenizing) == 1 and gated.inside == 1
                               and "short" in ledger.accepted)
            (long_id,) = tokenizer.tokenizing
            reply = await send_command(handle.control, m.CancelCommand(long_id))
            assert reply.ok, reply
            await ledger.until_ended(["long"])
            short_id = long_id.rsplit("/", 1)[0] + "/short"
            reply = await send_command(handle.control, m.CancelCommand(short_id))
            assert reply.ok, reply
            await ledger.until_ended(["short"])
            ledger.assert_cancelled_once(["long", "short"])
            gone = await send_command(handle.control, m.CancelCommand(long_id))
            assert not gone.ok  # ended: nothing is left to cancel
            gated.gate.set()
            await ledger.settle()
            assert "long" not in ledger.accepted and tokenizer.pending_prompt_bytes == 0
            await assert_drained_and_consistent(handle.control)
    finally:
        gated.gate.set()


async def test_cancel_while_queued_behind_a_full_batch(null_daemon) -> None:
    running = 2
    # the blockers are never paused: their chunks pile up in their stream instead
    handle = await start(null_daemon, scheduler={"max_running": running},
                         **{"stream.high_watermark": 10**9})
    async with connected(handle) as ledger:
        peer = ledger.peer
        blockers = [f"blocker-{i}" for i in range(running)]
        for rid in blockers:
            await peer.send(generate(rid, credits=0))
        await statuses(handle.control, lambda r: r.running == running)
        for round_ in range(3):
            queued = [f"queued-{round_}-{i}" for i in range(20)]
            for rid in queued:
                await peer.send(generate(rid))
            await ledger.until(lambda: ledger.accepted >= set(queued))
            await statuses(handle.control, lambda r: r.waiting == len(queued))
            for rid in queued:
                await peer.send(m.Cancel(rid))
            await ledger.until_ended(queued)
            ledger.assert_cancelled_once(queued)
            assert all(ledger.ends[rid][0].usage.completion_tokens == 0 for rid in queued)
            assert not any(ledger.chunks[rid] for rid in queued)
        for rid in blockers:  # decoding all along
            await peer.send(m.Cancel(rid))
        await ledger.until_ended(blockers)
        await ledger.settle()
        ledger.assert_cancelled_once(blockers)
        await assert_drained_and_consistent(handle.control)


async def test_cancel_in_the_middle_of_a_chunked_prefill(null_daemon) -> None:
    prefilling = 4
    prompt_tokens = 30_000  # at 8 tokens a step, thousands of steps of prefill
    handle = await start(null_daemon, scheduler={"max_prefill_chunk": 8,
                                                 "max_prefilling": prefilling})
    async with connected(handle) as ledger:
        peer = ledger.peer
        for round_ in range(4):
            rids = [f"prefill-{round_}-{i}" for i in range(prefilling)]
            for n, rid in enumerate(rids):
                first = 1000 + round_ * prefilling + n  # no two prompts share a cached prefix
                ids = (first, *(100 + (k % 5000) for k in range(prompt_tokens - 1)))
                await peer.send(generate(rid, prompt_ids=ids))
            await ledger.until(lambda: ledger.accepted >= set(rids))
            await statuses(handle.control, lambda r: r.running == prefilling)
            for rid in rids:
                await peer.send(m.Cancel(rid))
            await ledger.until_ended(rids)
            ledger.assert_cancelled_once(rids)
            # cancelled before the prompt was done: no token was ever made
            assert all(ledger.ends[rid][0].usage.completion_tokens == 0 for rid in rids)
        await ledger.settle()
        await assert_drained_and_consistent(handle.control)


async def test_cancel_while_decoding(null_daemon) -> None:
    handle = await start(null_daemon)
    async with connected(handle) as ledger:
        peer = ledger.peer
        for round_ in range(3):
            rids = [f"decode-{round_}-{i}" for i in range(20)]
            for rid in rids:
                await peer.send(generate(rid, credits=64))
            await ledger.until(lambda: all(ledger.chunks[rid] for rid in rids))
            for rid in rids:
                await peer.send(m.Cancel(rid))
            await ledger.until_ended(rids)
            ledger.assert_cancelled_once(rids)
            assert all(ledger.ends[rid][0].usage.completion_tokens >= 1 for rid in rids)
        await ledger.settle()
        await assert_drained_and_consistent(handle.control)


async def test_cancel_while_paused_for_credits(null_daemon) -> None:
    handle = await start(null_daemon)
    async with connected(handle) as ledger:
        peer = ledger.peer
        for round_ in range(3):
            rids = [f"paused-{round_}-{i}" for i in range(20)]
            for rid in rids:
                await peer.send(generate(rid, credits=1))
            await statuses(handle.control, lambda r: r.paused == len(rids))
            for n, rid in enumerate(rids):
                if n % 2:  # a credit's Resume travels the same route, ahead of the cancel
                    await peer.send(m.Credit(rid, 64))
                await peer.send(m.Cancel(rid))
            await ledger.until_ended(rids)
            ledger.assert_cancelled_once(rids)
            assert all(ledger.ends[rid][0].usage.completion_tokens >= 1 for rid in rids)
        await ledger.settle()
        await assert_drained_and_consistent(handle.control)
