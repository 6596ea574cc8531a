"""Exceptions inside actors: one request's own work that raises ends that request alone,
without a restart; any other exception restarts the actor. Only the affected requests end
with an error, everything else carries on, and no KV block leaks."""

from __future__ import annotations

import trio
import zmq

from sluice.ipc.client import AsyncClient

NULL_TEXT = " the quick brown fox jumps over the lazy dog"


async def read_slowly(generation, delay: float = 0.005) -> list[str]:
    texts = []
    async for chunk in generation:
        texts.append(chunk.text)
        await trio.sleep(delay)
    return texts


async def test_tokenizer_crash_fails_only_the_request_it_was_handling(null_daemon) -> None:
    handle = await null_daemon()
    daemon = handle.daemon
    with trio.fail_after(30):
        async with AsyncClient(handle.listen, credit_window=2) as client:
            survivor = await client.generate("a", max_tokens=200, temperature=0)
            victim = await client.generate("b", max_tokens=200, temperature=0)
            state = next(s for s in daemon.tokenizer.requests.values()
                         if s.client_id == victim.request_id)

            def explode(token_ids):
                raise RuntimeError("injected detokenizer fault")

            state.text.push = explode
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_slowly, victim)
                texts = await read_slowly(survivor)
            assert victim.result.finish_reason == "error"
            assert "tokenizer failed" in victim.result.error
            assert survivor.result.finish_reason == "length"
            assert len(survivor.result.token_ids) == 200
            assert "".join(texts).startswith(NULL_TEXT * 3)
            # the failure was that request's own: it ended alone, and nothing restarted
            assert "tokenizer" not in daemon.supervisor.restarts
            later = await client.generate("c", max_tokens=5)
            assert (await later.collect()).finish_reason == "length"


class FaultyTokenizer:
    """The real tokenizer, except that encoding "boom" raises."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def encode(self, text):
        if text == "boom":
            raise RuntimeError("injected tokenizer fault")
        return self._inner.encode(text)


async def test_tokenizer_crash_while_encoding_fails_that_request(null_daemon) -> None:
    handle = await null_daemon()
    daemon = handle.daemon
    daemon.tokenizer.tokenizer = FaultyTokenizer(daemon.tokenizer.tokenizer)
    with trio.fail_after(30):
        async with AsyncClient(handle.listen, credit_window=2) as client:
            running = await client.generate("fine", max_tokens=100)
            broken = await client.generate("boom", max_tokens=3)
            assert (await broken.collect()).finish_reason == "error"
            assert broken.result.token_ids == []
            assert (await running.collect()).finish_reason == "length"
            assert len(running.result.token_ids) == 100
            assert "tokenizer" not in daemon.supervisor.restarts


async def test_stream_crash_fails_its_connection_only(null_daemon) -> None:
    handle = await null_daemon()
    daemon = handle.daemon
    with trio.fail_after(30):
        async with AsyncClient(handle.listen, credit_window=2) as a, \
                AsyncClient(handle.listen, credit_window=2) as b:
            gen_a = await a.generate("a", max_tokens=100)
            gen_b = await b.generate("b", max_tokens=100)
            stream_a = daemon.gateway.streams[a._socket.zmq.getsockopt(zmq.ROUTING_ID)]

            def explode(request):
                del stream_a._flush  # fail once; the restarted stream uses the real one
                raise RuntimeError("injected stream fault")

            stream_a._flush = explode
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_slowly, gen_a)
                await read_slowly(gen_b)
            assert gen_a.result.finish_reason == "error"
            assert gen_b.result.finish_reason == "length"
            assert len(gen_b.result.token_ids) == 100
            # a connection's crash is its own: never counted toward the daemon's escalation
            assert stream_a.name not in daemon.supervisor.restarts
            again = await a.generate("a again", max_tokens=4)  # a fresh stream serves it
            assert (await again.collect()).finish_reason == "length"
