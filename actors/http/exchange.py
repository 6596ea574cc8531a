"""One HTTP generation's answer, and the ASGI responses the HTTP front and the metrics port
send.

`Exchange` turns the typed messages the front's Stream hands a request (`Accepted`, `Chunk`,
`Error`, `Finished`, or a `Rejected`, through its `Replies`) into the HTTP response: a
completion object, or server-sent events written as they come (what waits together, after a
few turns of the event loop, in one write), the chunks' credits given back in batches once
hypercorn took their bytes. The rest are small helpers over ASGI's `send`.

What does not belong here: routing, limits, keys and streams (`actors.http.front`), the OpenAI
shapes themselves (`actors.http.openai_api`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import structlog
import trio

from sluice.actors.http import openai_api as api
from sluice.actors.runtime.base import Outbox
from sluice.ipc import messages as m

_JSON = (b"content-type", b"application/json")
# turns a response lets the event loop take before it writes what it was handed. Idle, a turn
# costs microseconds and the write goes at once; under load, the tasks that run meanwhile
# bring the next steps' tokens, which join the same write. Each write is a socket send and
# hypercorn's work around it, the largest cost of a streamed token; at 64 streams on the
# null executor three turns gave ~1.3x the tokens/s and lower TPOT than writing at once.
_TURNS_BEFORE_WRITE = 3


class Replies:
    """What a request's stream said to its response and the response has not taken yet.

    One writer (the stream's sink) and one reader (the response), in one thread: a list
    taken whole, and an event while the response waits. What arrives while the response
    lets the loop take its turns (`_TURNS_BEFORE_WRITE`) is taken with the rest."""

    def __init__(self) -> None:
        self._items: list = []
        self._wake: trio.Event | None = None

    def put(self, msg: object) -> None:
        self._items.append(msg)
        if self._wake is not None:
            self._wake.set()

    async def take(self) -> list:
        """Everything waiting, once there is something."""
        while not self._items:
            self._wake = trio.Event()
            await self._wake.wait()
        self._wake = None
        for _ in range(_TURNS_BEFORE_WRITE):
            await trio.lowlevel.checkpoint()
        items, self._items = self._items, []
        return items


class Exchange:
    """One request's answer: the stream's messages in, the HTTP response out."""

    def __init__(self, request: api.ApiRequest, request_id: str, stream: Outbox,
                 replies: Replies, send: Callable, retry_after: int):
        self.request = request
        self.request_id = request_id
        self.stream = stream
        self.replies = replies
        self.send = send
        self.retry_after = retry_after
        self.created = api.now()
        self.prompt_tokens = 0
        self.started = False  # the SSE response's head was sent
        self.head = b""  # the first event of a streamed chat, written with the next ones
        self.text: list[str] = []  # the non-streamed answer
        self.logprobs: list[m.TokenLogprobs] = []  # the non-streamed answer's, when asked
        self.text_offset = 0  # where the next streamed token's text starts (completions)
        self.error = ""
        self.ended = False  # the stream ended the request (finished, or refused it)
        self.found_closed = False  # refused because the stream had closed: nothing was done
        # credits are given back in batches of half the window: the stream never runs dry
        # while a batch fills, and it hears from this response half as often (or less)
        self.credit_batch = max(1, request.generate.credits // 2)
        self.credits_owed = 0
        self.delta_event = api.DeltaEvents(request, request_id, self.created)
        self.first_token: trio.Event | None = None  # set at the first chunk, when given
        # a streamed answer whose `<tool_call>` blocks are sent as tool calls
        self.tool_calls = (api.ToolCalls(request.one_call)
                           if request.tool_calls and request.stream else None)
        self.calls_sent = 0

    async def run(self) -> None:
        while True:  # everything that waits is answered together, in one write
            if await self._take_all(await self.replies.take()):
                return

    async def _take_all(self, items: list) -> bool:
        """Handle the stream's messages in order; True once the request ended.

        Streamed events are written together, and their chunks' credits are given back
        together once hypercorn took the bytes (a full socket withholds them)."""
        events: list[bytes] = []
        for item in items:
            if isinstance(item, m.Chunk):
                if self.first_token is not None:
                    self.first_token.set()
                self.credits_owed += 1
                if self.tool_calls is not None:
                    events.append(self._tool_events(self.tool_calls.feed(item.text)))
                elif self.request.stream:
                    events.append(self._chunk_event(item))
                else:
                    self.text.append(item.text)
                    self.logprobs.extend(item.logprobs or ())
                continue
            if isinstance(item, m.Finished):  # the last events go in the same write
                self.ended = True
                await self._finish(item, b"".join(events))
                return True
            if events:
                await self._body(b"".join(events))
                events = []
            if await self._take(item):
                return True
        if events:
            await self._body(b"".join(events))
        if self.credits_owed >= self.credit_batch:
            self.stream.put(m.Credit(self.request.generate.request_id, self.credits_owed))
            self.credits_owed = 0
        return False

    async def _take(self, item: object) -> bool:
        """Handle one message of the stream but a chunk or the end; True once the request
        ended."""
        if isinstance(item, m.Accepted):
            self.prompt_tokens = item.prompt_tokens
            if self.request.stream:
                await self._start()
        elif isinstance(item, m.Error):
            self.error = item.message
        elif isinstance(item, m.Rejected):
            self.ended = True
            self.found_closed = (item.code is m.RejectCode.OVERLOADED
                                 and item.field == "connection" and not self.started)
            raise api.rejected_error(item, self.retry_after)
        return False

    def _chunk_event(self, chunk: m.Chunk) -> bytes:
        """One event for the chunk; a chunk without text (a piece of a character) makes one
        only to carry its tokens' logprobs, and one with neither, none."""
        if chunk.logprobs is None:
            return self.delta_event(chunk.text) if chunk.text else b""
        tokens = list(chunk.logprobs)
        if not chunk.text and not tokens:
            return b""
        logprobs = api.logprobs_body(self.request, tokens, self.text_offset)
        self.text_offset += sum(len(t.token) for t in tokens)
        return api.stream_event(self.request, self.request_id, self.created, chunk.text, None,
                                logprobs=logprobs)

    def _tool_events(self, parts: list) -> bytes:
        """The events of a streamed answer's content and tool calls."""
        events = []
        for kind, part in parts:
            if kind == "content":
                events.append(self.delta_event(part))
            else:
                events.append(api.tool_call_event(self.request, self.request_id, self.created,
                                                  self.calls_sent, part))
                self.calls_sent += 1
        return b"".join(events)

    async def _start(self) -> None:
        self.started = True
        await self.send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        if self.request.chat:  # OpenAI's first delta names the role; sent with what follows
            self.head = api.stream_event(self.request, self.request_id, self.created, "", None,
                                         first=True)

    async def _body(self, data: bytes, more: bool = True) -> None:
        if self.head:  # each write is a send of its own on the socket: the role rides along
            data, self.head = self.head + data, b""
        await self.send({"type": "http.response.body", "body": data, "more_body": more})

    async def _finish(self, finished: m.Finished, pending: bytes = b"") -> None:
        """Answer the request's end; `pending` are streamed events not written yet."""
        reason = finished.reason
        if reason not in (m.FinishReason.STOP, m.FinishReason.LENGTH):
            error = api.ended_error(reason, self.error)
            if not self.started:
                raise error
            await self._body(pending + api.sse(error.body()), more=False)
            return
        used = api.usage(self.prompt_tokens, finished)
        finish = api.finish_reason(reason)
        if not self.request.stream:
            await send_json(self.send, 200, api.completion_body(
                self.request, self.request_id, self.created, "".join(self.text), finish, used,
                api.logprobs_body(self.request, self.logprobs)))
            return
        if self.tool_calls is not None:
            pending += self._tool_events(self.tool_calls.end())
            if self.calls_sent and finish == "stop":
                finish = "tool_calls"
        events = pending + api.stream_event(self.request, self.request_id, self.created, None,
                                            finish)
        if self.request.include_usage:
            events += api.stream_event(self.request, self.request_id, self.created, None, None,
                                       used=used)
        await self._body(events + api.SSE_DONE, more=False)


class ClientGone(Exception):
    """The HTTP client disconnected, or took no response write within the deadline."""


def deadline_send(send: Callable, timeout: float) -> Callable:
    """ASGI's `send`, each call given `timeout` seconds: a client that does not take its
    response (a shut HTTP/2 window, which no socket timeout sees) is taken for gone."""
    async def send_in_time(message: dict) -> None:
        with trio.move_on_after(timeout):
            await send(message)
            return
        raise ClientGone

    return send_in_time


async def watch_disconnect(receive: Callable, scope: trio.CancelScope) -> None:
    """End the exchange when the client goes (its stream is told by the caller's `finally`)."""
    while True:
        event = await receive()
        if event["type"] == "http.disconnect":
            scope.cancel()
            return


async def serve_lifespan(receive: Callable, send: Callable) -> None:
    """Answer an ASGI server's lifespan events: this app needs no startup or shutdown."""
    while True:
        event = await receive()
        if event["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif event["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def header(scope: dict, name: bytes) -> bytes:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value
    return b""


async def send_json(send: Callable, status: int, payload: dict,
                     headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [_JSON, (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


async def send_text(send: Callable, status: int, text: str) -> None:
    body = text.encode() + b"\n"
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Callable, error: api.ApiError) -> None:
    headers = []
    if error.retry_after is not None:
        headers.append((b"retry-after", str(error.retry_after).encode()))
    if error.status == 413:  # the rest of the body is never read: this connection is done
        headers.append((b"connection", b"close"))
    await send_json(send, error.status, error.body(), headers)


class _ToStructlog(logging.Handler):
    """hypercorn's own lines (a protocol error, an app that raised) in the daemon's logs."""

    def emit(self, record: logging.LogRecord) -> None:
        fields = {}
        if record.exc_info:
            fields["exception"] = logging.Formatter().formatException(record.exc_info)
        level = "error" if record.levelno >= logging.ERROR else (
            "warning" if record.levelno >= logging.WARNING else "debug")
        getattr(structlog.get_logger(record.name), level)(record.getMessage(), **fields)


def server_log(name: str) -> logging.Logger:
    """The standard logger to give hypercorn as its error log."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        logger.addHandler(_ToStructlog())
        logger.propagate = False
    return logger
