"""The Stream actor's backpressure and liveness rules, driven by messages on a virtual clock.

Everything the stream says about a request goes to the Tokenizer (the request's one route),
in order behind its `Encode`; the stream has no line to the Scheduler."""

from __future__ import annotations

import trio
import trio.testing

from sluice.actors.runtime import messages as am
from sluice.actors.runtime.base import Inbox
from sluice.actors.front.stream import Stream, StreamConfig
from sluice.actors.runtime.supervisor import Supervisor
from sluice.ipc import messages as m
from sluice.ipc.codec import Codec

CONFIG = StreamConfig(heartbeat_interval=1.0, heartbeat_timeout=5.0, pause_timeout=3.0,
                      high_watermark=3, low_watermark=1)
client_codec = Codec(m.SERVER_MESSAGES)


def drain(inbox: Inbox) -> list:
    items = []
    while True:
        try:
            items.append(inbox.get_nowait())
        except trio.WouldBlock:
            return items


def sent_to_client(gateway: Inbox) -> list:
    """Decoded client-bound messages, heartbeats left out."""
    out = []
    for item in drain(gateway):
        if isinstance(item, am.Outbound):
            out.extend(msg for f in item.frames for msg in client_codec.decode_batch(f))
    return [msg for msg in out if not isinstance(msg, m.Heartbeat)]


class Harness:
    def __init__(self, nursery: trio.Nursery, config: StreamConfig = CONFIG):
        self.gateway, self.tokenizer = Inbox("g"), Inbox("t")
        self.stream = Stream(b"conn", config=config, codec=Codec(), gateway=self.gateway,
                             tokenizer=self.tokenizer)

    async def start(self, nursery: trio.Nursery) -> None:
        await nursery.start(self.stream.run)

    async def tell(self, msg) -> None:
        self.stream.inbox.put(msg)
        await trio.testing.wait_all_tasks_blocked()

    async def generate(self, rid: str = "r", credits: int = 1) -> str:
        await self.tell(m.Generate(rid, prompt="x", credits=credits))
        [encode] = drain(self.tokenizer)
        return encode.request_id

    async def deliver(self, *items) -> None:
        await self.tell(am.Deliver.of(items))


def chunk(text: str, token: int, rid: str = "r") -> m.Chunk:
    return m.Chunk(rid, text, (token,))


async def test_chunks_wait_for_credits_and_merge(autojump_clock, nursery) -> None:
    h = Harness(nursery)
    await h.start(nursery)
    await h.generate(credits=1)
    await h.deliver(chunk("a", 1), chunk("b", 2), chunk("c", 3),
                    m.Finished("r", m.FinishReason.LENGTH))
    first = sent_to_client(h.gateway)
    assert [(c.text, c.token_ids) for c in first] == [("a", (1,))]
    await h.tell(m.Credit("r", 1))
    rest = sent_to_client(h.gateway)
    assert isinstance(rest[0], m.Chunk) and (rest[0].text, rest[0].token_ids) == ("bc", (2, 3))
    assert isinstance(rest[1], m.Finished) and rest[1].reason is m.FinishReason.LENGTH


async def test_merged_chunks_keep_each_token_s_logprobs(autojump_clock, nursery) -> None:
    h = Harness(nursery)
    await h.start(nursery)
    await h.generate(credits=1)
    entry = [m.TokenLogprobs(t, -float(i), (m.TopLogprob(i, t, -float(i)),))
             for i, t in enumerate("abc")]
    await h.deliver(m.Chunk("r", "a", (1,), (entry[0],)), m.Chunk("r", "", (2,), (entry[1],)),
                    m.Chunk("r", "bc", (3,), (entry[2],)),
                    m.Chunk("r", "!", ()),  # held text released at the end: no token
                    m.Finished("r", m.FinishReason.LENGTH))
    [first] = sent_to_client(h.gateway)
    assert first.logprobs == (entry[0],)
    await h.tell(m.Credit("r", 1))
    merged = sent_to_client(h.gateway)[0]
    assert (merged.text, merged.token_ids, merged.logprobs) == ("bc!", (2, 3), tuple(entry[1:]))


async def test_high_watermark_pauses_and_low_watermark_resumes(autojump_clock, nursery) -> None:
    h = Harness(nursery)
    await h.start(nursery)
    rid = await h.generate(credits=0)
    await h.deliver(*(chunk("t", i) for i in range(3)))
    assert drain(h.tokenizer) == []  # at the watermark, not past it
    await h.deliver(chunk("t", 3))
    assert drain(h.tokenizer) == [am.PauseDecoding(rid)]
    await h.tell(m.Credit("r", 1))  # the whole buffer leaves as one chunk
    assert drain(h.tokenizer) == [am.ResumeDecoding(rid)]


async def test_paused_past_pause_timeout_is_released_with_timeout(autojump_clock, nursery) -> None:
    h = Harness(nursery)
    await h.start(nursery)
    rid = await h.generate(credits=0)
    await h.deliver(*(chunk("t", i) for i in range(5)))
    assert drain(h.tokenizer) == [am.PauseDecoding(rid)]
    for _ in range(4):  # keep the connection alive: it is slow, not gone
        await trio.sleep(1)
        await h.tell(m.Heartbeat())
    assert drain(h.tokenizer) == [am.Release((rid,), m.FinishReason.TIMEOUT)]
    await h.deliver(m.Finished("r", m.FinishReason.TIMEOUT))
    [finished] = sent_to_client(h.gateway)  # buffered chunks are dropped, not sent
    assert finished.reason is m.FinishReason.TIMEOUT


async def test_silent_client_is_gone_and_everything_released(autojump_clock, nursery) -> None:
    h = Harness(nursery)
    await h.start(nursery)
    first = await h.generate("a")
    second = await h.generate("b")
    await trio.sleep(CONFIG.heartbeat_timeout + 1)
    released = drain(h.tokenizer)
    # given up unattended: neither sent a token, so both marks are 0.0
    assert released == [am.Release((first, second), m.FinishReason.CANCELLED, (0.0, 0.0))]
    assert am.StreamClosed(b"conn") in drain(h.gateway)


async def test_cancel_releases_and_drops_the_buffer(autojump_clock, nursery) -> None:
    h = Harness(nursery)
    await h.start(nursery)
    rid = await h.generate(credits=0)
    await h.deliver(chunk("a", 1))
    await h.tell(m.Cancel("r"))
    assert drain(h.tokenizer) == [am.Release((rid,), m.FinishReason.CANCELLED)]
    await h.deliver(m.Finished("r", m.FinishReason.CANCELLED))
    [finished] = sent_to_client(h.gateway)
    assert finished.reason is m.FinishReason.CANCELLED


async def test_duplicate_request_id_is_rejected(autojump_clock, nursery) -> None:
    h = Harness(nursery)
    await h.start(nursery)
    await h.generate("r")
    await h.tell(m.Generate("r", prompt="again"))
    [rejected] = sent_to_client(h.gateway)
    assert isinstance(rejected, m.Rejected) and rejected.field == "request_id"


async def test_generate_and_cancel_leave_in_order_on_one_route(autojump_clock, nursery) -> None:
    h = Harness(nursery)
    await h.start(nursery)
    h.stream.inbox.put(m.Generate("r", prompt="x"))
    h.stream.inbox.put(m.Cancel("r"))
    await trio.testing.wait_all_tasks_blocked()
    encode, release = drain(h.tokenizer)
    assert isinstance(encode, am.Encode)
    assert release == am.Release((encode.request_id,), m.FinishReason.CANCELLED)


async def test_a_crash_mid_message_still_sends_the_ends_made_before_it(autojump_clock) -> None:
    class FaultyStream(Stream):
        def _ended(self, request, finished):
            if request.client_id == "b":
                raise RuntimeError("injected stream fault")
            return super()._ended(request, finished)

    gateway, tokenizer = Inbox("g"), Inbox("t")
    stream = FaultyStream(b"conn", config=CONFIG, codec=Codec(), gateway=gateway,
                          tokenizer=tokenizer)
    supervisor = Supervisor()
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run, [])
        await supervisor.start_child(stream, transient=True)
        stream.inbox.put(m.Generate("a", prompt="x", credits=1))
        stream.inbox.put(m.Generate("b", prompt="x", credits=0))
        await trio.testing.wait_all_tasks_blocked()
        drain(tokenizer)
        # a ends; then b's end crashes the stream
        stream.inbox.put(am.Deliver.of((m.Finished("a", m.FinishReason.LENGTH),
                                        m.Finished("b", m.FinishReason.LENGTH))))
        await trio.sleep(1)
        ends = {msg.request_id: msg.reason for msg in sent_to_client(gateway)
                if isinstance(msg, m.Finished)}
        assert ends == {"a": m.FinishReason.LENGTH, "b": m.FinishReason.ERROR}
        nursery.cancel_scope.cancel()
