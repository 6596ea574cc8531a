"""An HTTP connection is freed when it closes, whatever its request came to: served, refused
before its body was read, refused in the middle of it, or refused by the parser on a worker
thread. What a closed connection leaves in a reference cycle (its protocol, its buffers, its
socket, an error and the frames that raised it) waits for a full pass of the garbage
collector, which the daemon runs once a minute: under a stream of such clients the daemon
held hundreds of megabytes between passes. KV check after."""

from __future__ import annotations

import gc
import json
import socket

import trio

from sluice.actors.http import openai_api, server
from sluice.actors.http.front import PARSE_ON_LOOP_BYTES

MAX_BODY = 4 * PARSE_ON_LOOP_BYTES


def exchange(address: str, head: str, body: bytes = b"") -> bytes:
    """One request on its own connection (`connection: close`); the whole answer."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + b"connection: close\r\n\r\n" + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def post_head(length: int | None) -> str:
    size = "transfer-encoding: chunked\r\n" if length is None else f"content-length: {length}\r\n"
    return f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{size}"


def requests(model: str) -> list[tuple[str, bytes, bytes]]:
    """(head, body, the status line's start) of each kind of request."""
    served = json.dumps({"model": model, "prompt": "hi", "max_tokens": 2}).encode()
    deep = b"[" * (PARSE_ON_LOOP_BYTES + 1)  # parsed on a worker thread, and refused there
    chunk = b"x" * (MAX_BODY + 1)
    chunked = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n0\r\n\r\n"
    return [
        ("GET /health HTTP/1.1\r\nhost: x\r\n", b"", b"HTTP/1.1 200"),
        ("GET /nowhere HTTP/1.1\r\nhost: x\r\n", b"", b"HTTP/1.1 404"),
        (post_head(len(served)), served, b"HTTP/1.1 200"),
        (post_head(MAX_BODY + 1), b"", b"HTTP/1.1 413"),  # refused before a byte is read
        (post_head(None), chunked, b"HTTP/1.1 413"),  # refused in the middle of the body
        (post_head(len(deep)), deep, b"HTTP/1.1 400"),
    ]


def cyclic_garbage() -> list[str]:
    """The names of the HTTP front's objects that only the cycle collector would free."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        kinds = (server.Connection, openai_api.ApiError, server._Http1)
        return sorted({type(obj).__name__ for obj in gc.garbage if isinstance(obj, kinds)})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


async def test_a_closed_http_connection_leaves_no_reference_cycle(null_daemon) -> None:
    handle = await null_daemon(**{"http.listen": "127.0.0.1:0",
                                  "http.max_body_bytes": MAX_BODY})
    address = handle.daemon.http_address
    connections = handle.daemon.http.connections
    models = await trio.to_thread.run_sync(
        exchange, address, "GET /v1/models HTTP/1.1\r\nhost: x\r\n")
    model = json.loads(models.split(b"\r\n\r\n", 1)[1])["data"][0]["id"]
    with trio.fail_after(30):
        while len(connections):
            await trio.sleep(0.01)
    gc.collect()  # what came before
    for head, body, status in requests(model):
        for _ in range(3):
            answer = await trio.to_thread.run_sync(exchange, address, head, body)
            assert answer.startswith(status), (head, answer[:300])
    with trio.fail_after(30):
        while len(connections):  # every connection's task is done
            await trio.sleep(0.01)
    assert cyclic_garbage() == []
    await handle.check()
