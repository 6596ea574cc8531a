"""The daemon's OpenAI-compatible front as the soak's clients see it.

The well-behaved HTTP client (streamed chat completions on a keep-alive connection, over h11,
as an application's HTTP library sends them), the raw-socket helpers the hostile HTTP modes
(`soak_http_hostile.py`) build their requests with, and the tenants the soak gives API
keys, so that the front's per-tenant shares apply between them.
"""

from __future__ import annotations

import json
import socket
from typing import TYPE_CHECKING

import h11
import trio

from soak_wire import PROMPT_MARK

if TYPE_CHECKING:
    from soak import WellBehaved

# the well-behaved HTTP clients' tenant and the hostile HTTP clients' two, apart from the
# ZeroMQ strangers (a tenant that owns a key is refused on the plain ZeroMQ socket). The
# tricklers have a tenant of their own: the bodies they hold take their tenant's whole share
# of body reads, and the other hostile modes' requests would only ever be refused for it
WEB_TENANT = "web"
WEB_STRANGERS = "web-strangers"
WEB_TRICKLERS = "web-tricklers"
HTTP_KEYS = {WEB_TENANT: "soak-web-key", WEB_STRANGERS: "soak-strangers-key",
             WEB_TRICKLERS: "soak-tricklers-key"}

_RECEIVE_BYTES = 65536


# -- raw sockets, for the hostile modes ---------------------------------------------------------


async def connect(address: str, *, rcvbuf: int | None = None) -> trio.socket.SocketType:
    """A TCP connection to `HOST:PORT` (loopback); `rcvbuf`: a small kernel receive buffer,
    set before the handshake so that the window the daemon sees is small too."""
    host, port = address.rsplit(":", 1)
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    try:
        await sock.connect((host, int(port)))
    except BaseException:
        sock.close()
        raise
    return sock


async def send_all(sock: trio.socket.SocketType, data: bytes) -> bool:
    """False when the daemon closed or reset the connection first."""
    view = memoryview(data)
    try:
        while view:
            view = view[await sock.send(view):]
    except OSError:
        return False
    return True


async def read_to_close(sock: trio.socket.SocketType, timeout: float,
                        limit: int = 1 << 20) -> tuple[bytes, bool]:
    """What the daemon sent within `timeout` (at most `limit` bytes), and whether it closed
    the connection (or reset it) meanwhile."""
    received = bytearray()
    with trio.move_on_after(timeout):
        while len(received) < limit:
            try:
                chunk = await sock.recv(_RECEIVE_BYTES)
            except OSError:
                return bytes(received), True
            if not chunk:
                return bytes(received), True
            received += chunk
    return bytes(received), False


async def exchange(address: str, data: bytes, timeout: float) -> tuple[bytes, bool]:
    """`data` on a fresh connection, then `read_to_close`."""
    sock = await connect(address)
    try:
        await send_all(sock, data)
        return await read_to_close(sock, timeout)
    finally:
        sock.close()


def status_of(answer: bytes) -> int | None:
    """The status of the first response in `answer`; None when none began."""
    parts = answer.split(b" ", 2)
    if len(parts) < 3 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return None
    return int(parts[1])


def error_of(answer: bytes) -> dict:
    """The OpenAI-shaped `error` object of a response with a body; {} when there is none."""
    try:
        return json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
    except (ValueError, KeyError, TypeError):
        return {}


def request(method: str, target: str, body: bytes = b"", *, key: str = "",
            close: bool = True, headers: bytes = b"", length: int | None = None) -> bytes:
    """An HTTP/1.1 request's bytes; `length`: a `content-length` other than the body's."""
    return (f"{method} {target} HTTP/1.1\r\nhost: soak\r\n".encode()
            + b"content-type: application/json\r\n"
            + (f"authorization: Bearer {key}\r\n".encode() if key else b"")
            + (b"connection: close\r\n" if close else b"")
            + b"content-length: %d\r\n" % (len(body) if length is None else length)
            + headers + b"\r\n" + body)


# -- the well-behaved HTTP client ---------------------------------------------------------------


class StaleConnection(Exception):
    """A kept-alive connection the daemon closed while it was idle: send again on a new one."""


class WebClient:
    """One application's keep-alive connection to the front, with its tenant's key. A
    connection the daemon closed while it was idle (its keep-alive timeout, or room made at
    the connection cap) is opened again and the request sent again, as HTTP libraries do
    when nothing of an answer came."""

    def __init__(self, address: str, key: str):
        self.address, self.key = address, key
        self.stream: trio.SocketStream | None = None
        self.h11 = h11.Connection(h11.CLIENT)
        self.reconnects = 0

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()
            self.stream = None

    async def model(self) -> str:
        status, events, body = await self.send("GET", "/v1/models", None)
        if status != 200:
            raise OSError(f"GET /v1/models answered {status}: {body[:200]!r}")
        return json.loads(body)["data"][0]["id"]

    async def send(self, method: str, target: str,
                   payload: dict | None) -> tuple[int, list[dict], bytes]:
        """(status, the server-sent events of a 200 stream, any other body)."""
        for _ in range(2):
            reused = self.stream is not None
            if not reused:
                host, port = self.address.rsplit(":", 1)
                self.stream = await trio.open_tcp_stream(host, int(port))
                self.h11 = h11.Connection(h11.CLIENT)
            try:
                return await self._exchange(method, target, payload, reused)
            except StaleConnection:
                self.reconnects += 1
                await self.aclose()
        raise OSError("a fresh connection was closed before any answer")

    async def _exchange(self, method: str, target: str, payload: dict | None,
                        reused: bool) -> tuple[int, list[dict], bytes]:
        body = b"" if payload is None else json.dumps(payload).encode()
        headers = [("host", "soak"), ("content-type", "application/json"),
                   ("content-length", str(len(body))), ("authorization", f"Bearer {self.key}")]
        conn, status, events, received, pending = self.h11, 0, [], [], b""
        try:
            await self.stream.send_all(conn.send(h11.Request(method=method, target=target,
                                                             headers=headers))
                                       + conn.send(h11.Data(data=body))
                                       + conn.send(h11.EndOfMessage()))
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await self.stream.receive_some(_RECEIVE_BYTES))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    if status == 200 and payload is not None and payload.get("stream"):
                        pending += bytes(event.data)
                        *complete, pending = pending.split(b"\n\n")
                        events += [json.loads(text.removeprefix(b"data: "))
                                   for text in complete if text != b"data: [DONE]"]
                    else:
                        received.append(bytes(event.data))
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
        except (OSError, trio.BrokenResourceError, h11.RemoteProtocolError) as exc:
            await self.aclose()
            if reused and status == 0:
                raise StaleConnection() from None
            raise OSError(f"{method} {target}: {type(exc).__name__}: {exc}") from None
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        else:
            await self.aclose()
        return status, events, b"".join(received)


async def model_name(address: str, timeout: float = 10.0) -> str:
    """The served model's name, as `/v1/models` lists it."""
    client = WebClient(address, HTTP_KEYS[WEB_TENANT])
    try:
        with trio.fail_after(timeout):
            return await client.model()
    finally:
        await client.aclose()


async def well_behaved_http_client(address: str, model: str, number: int, max_tokens: int,
                                   timeout: float, record: WellBehaved,
                                   stop: trio.Event) -> None:
    """One HTTP application: a streamed chat completion with its tenant's key, read to its
    last event, a short think, again."""
    client = WebClient(address, HTTP_KEYS[WEB_TENANT])
    try:
        n = 0
        while not stop.is_set():
            n += 1
            started = trio.current_time()
            payload = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True, "messages": [{
                           "role": "user", "content": f"{PROMPT_MARK} web {number} asks #{n}"}]}
            try:
                with trio.fail_after(timeout):
                    status, events, body = await client.send("POST", "/v1/chat/completions",
                                                             payload)
            except trio.TooSlowError:
                record.failures[f"no answer within {timeout:g}s"] += 1
                await client.aclose()
                continue
            except OSError as exc:
                record.failures[f"connection: {str(exc)[:80]}"] += 1
                await trio.sleep(0.2)
                continue
            finally:
                record.reconnects += client.reconnects
                client.reconnects = 0
            _record_answer(record, status, events, body, started)
            await trio.sleep(0.05)
    finally:
        await client.aclose()


def _record_answer(record: WellBehaved, status: int, events: list[dict], body: bytes,
                   started: float) -> None:
    if status != 200:
        try:
            code = json.loads(body)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = body[:60]
        record.failures[f"http {status}: {code}"] += 1
        return
    record.accepted += 1
    errors = [event["error"].get("code") for event in events if event.get("error")]
    reasons = [choice["finish_reason"] for event in events
               for choice in event.get("choices", ()) if choice.get("finish_reason")]
    if errors:
        record.failures[f"error event: {errors[0]}"] += 1
    elif len(reasons) != 1:
        record.failures[f"{len(reasons)} finish reasons"] += 1
        record.without_finished += not reasons
    elif reasons[0] in ("length", "stop"):
        record.latencies.append(trio.current_time() - started)
        record.spans.append((started, trio.current_time()))
    else:
        record.failures[f"finished: {reasons[0]}"] += 1
