"""The HTTP side of `sluice bench --http URL`: streamed OpenAI completions on trio, over h11.

A small client of the daemon's OpenAI-compatible front, enough to drive it with the same
workloads as the ZeroMQ client and time each server-sent event: keep-alive connections in a
pool, one request at a time on each, `stream: true` with the usage asked for in the last
event. Server-sent events do not say how many tokens each carries, so a request's
inter-token gaps are its event gaps spread over the tokens its usage counts; that usage
also gives the prompt and output lengths the report records.

What does not belong here: the report (see `bench`), anything of the daemon.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11
import trio

from sluice.daemon.commands.bench_record import Sample

_RECEIVE_BYTES = 65536


class HttpLoadError(Exception):
    """The front could not be reached or answered nonsense."""


@dataclass
class _Connection:
    stream: trio.SocketStream
    h11: h11.Connection


class HttpFront:
    """Requests to one `http://HOST:PORT`, on a pool of keep-alive connections."""

    def __init__(self, url: str, keys: dict[str, str]):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"--http {url}: expected http://HOST:PORT")
        self.host, self.port = parts.hostname, parts.port or 80
        self.keys = keys  # tenant -> API key
        self.idle: list[_Connection] = []
        self.model = ""

    async def aclose(self) -> None:
        for connection in self.idle:
            await connection.stream.aclose()
        self.idle.clear()

    async def start(self) -> None:
        any_tenant = next(iter(self.keys), "")  # with keys, listing the models needs one
        status, body = await self._exchange("GET", "/v1/models", None, any_tenant)
        if status != 200:
            raise HttpLoadError(f"GET /v1/models answered {status}: {body[:200]!r}")
        self.model = json.loads(body)["data"][0]["id"]

    async def generate(self, item: dict, tenant: str, sample: Sample, *, max_tokens: int,
                       temperature: float, ignore_eos: bool) -> None:
        chat = "messages" in item
        payload = {"model": self.model, "max_tokens": max_tokens, "temperature": temperature,
                   "ignore_eos": ignore_eos, "stream": True,
                   "stream_options": {"include_usage": True}}
        for key in ("prompt", "messages"):
            if key in item:
                payload[key] = item[key]
        if "prompt_ids" in item:
            payload["prompt"] = list(item["prompt_ids"])
        path = "/v1/chat/completions" if chat else "/v1/completions"
        gaps: list[float] = []
        events = 0
        last = None

        def on_event(event: dict) -> None:
            nonlocal events, last
            if event.get("error"):
                sample.finish_reason = event["error"].get("code") or "error"
                return
            if event.get("usage"):
                usage = event["usage"]
                sample.tokens = sample.completion_tokens = usage["completion_tokens"]
                sample.prompt_tokens = usage["prompt_tokens"]
            for choice in event.get("choices", ()):
                text = choice.get("text") if not chat else choice["delta"].get("content")
                if text:
                    now = time.perf_counter()
                    if sample.ttft is None:
                        sample.ttft = now - sample.start
                    elif last is not None:
                        gaps.append(now - last)
                    last = now
                    events += 1
                if choice.get("finish_reason"):
                    sample.finish_reason = choice["finish_reason"]

        status, body = await self._exchange("POST", path, payload, tenant, on_event)
        if status != 200:
            try:
                sample.rejected = json.loads(body)["error"]["code"] or str(status)
            except (ValueError, KeyError, TypeError):
                sample.rejected = str(status)
            return
        sample.e2e = time.perf_counter() - sample.start
        if sample.tokens > 1 and events:
            spread = events / sample.tokens  # tokens per event, on average
            sample.itl = [gap * spread for gap in gaps]

    async def _exchange(self, method: str, path: str, payload: dict | None, tenant: str,
                        on_event=None) -> tuple[int, bytes]:
        """One request; (status, body). A 200 event stream goes to `on_event` instead."""
        connection = self.idle.pop() if self.idle else await self._connect()
        body = b"" if payload is None else json.dumps(payload).encode()
        headers = [("host", f"{self.host}:{self.port}"), ("content-length", str(len(body))),
                   ("content-type", "application/json")]
        if self.keys.get(tenant):
            headers.append(("authorization", f"Bearer {self.keys[tenant]}"))
        conn = connection.h11
        try:
            await connection.stream.send_all(conn.send(h11.Request(method=method, target=path,
                                                                   headers=headers))
                                             + conn.send(h11.Data(data=body))
                                             + conn.send(h11.EndOfMessage()))
            status, received, pending = 0, [], b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await connection.stream.receive_some(_RECEIVE_BYTES))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    if status == 200 and on_event is not None:
                        pending += bytes(event.data)
                        *complete, pending = pending.split(b"\n\n")
                        for text in complete:
                            data = text.removeprefix(b"data: ")
                            if data != b"[DONE]":
                                on_event(json.loads(data))
                    else:
                        received.append(bytes(event.data))
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
        except (OSError, trio.BrokenResourceError, h11.ProtocolError) as exc:
            await connection.stream.aclose()
            raise HttpLoadError(f"{method} {path}: {exc}") from None
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
            self.idle.append(connection)
        else:
            await connection.stream.aclose()
        return status, b"".join(received)

    async def _connect(self) -> _Connection:
        stream = await trio.open_tcp_stream(self.host, self.port)
        return _Connection(stream, h11.Connection(h11.CLIENT))
