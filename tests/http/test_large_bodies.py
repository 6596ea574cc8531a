"""A large request body is parsed off the event loop, where megabytes of JSON would hold
every other client's stream; a small one is parsed where it is read. Both are served alike.
KV check after."""

from __future__ import annotations

import json
import socket
import threading
import urllib.request

import trio

from sluice.actors.http import openai_api
from sluice.actors.http.front import PARSE_ON_LOOP_BYTES


def post(address: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\nconnection: close\r\n\r\n").encode()
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head + data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


async def test_a_large_body_is_parsed_on_a_worker_thread(null_daemon, monkeypatch) -> None:
    handle = await null_daemon(**{"http.listen": "127.0.0.1:0"})
    address = handle.daemon.http_address
    on_loop: list[bool] = []
    parse = openai_api.parse_body

    def watched(raw: bytes):
        on_loop.append(threading.current_thread() is threading.main_thread())
        return parse(raw)

    monkeypatch.setattr(openai_api, "parse_body", watched)
    models = await trio.to_thread.run_sync(
        lambda: urllib.request.urlopen(f"http://{address}/v1/models", timeout=30).read())
    small = {"model": json.loads(models)["data"][0]["id"], "prompt": "hi", "max_tokens": 2}
    large = {**small, "user": "x" * (4 * PARSE_ON_LOOP_BYTES)}  # accepted, and unused
    on_loop.clear()
    for body in (small, large):
        answer = await trio.to_thread.run_sync(post, address, body)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert on_loop == [True, False]
    await handle.check()
