"""Hostile HTTP clients for the soak: raw sockets against the daemon's OpenAI-compatible front.

Each mode is one way a stranger can misuse the front (hold idle connections, trickle a body,
never read a stream, speak HTTP/2 unasked, send an oversize request line, a body that is not
JSON, values no field takes) and runs in the hostile clients' process (`soak_hostile.py`)
until `stop`, each loop bounded in count and time and talking only to the front on loopback,
with a hostile tenant's API key. What comes back is counted in the mode's tally; an answer other
than the one the README promises is counted as `unexpected: ...`, which the report lists as a
problem. The well-behaved HTTP client and the raw-socket helpers are in `soak_http.py`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Awaitable, Callable

import trio

from soak_http import connect, error_of, exchange, read_to_close, request, send_all, status_of
from soak_wire import PROMPT_MARK, Tally

# the opening of HTTP/2 with prior knowledge: the preface, then an empty SETTINGS frame
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
# an HTTP/1.1 request asking to switch to HTTP/2 in cleartext (h2c), its settings in base64
H2C_UPGRADE = (b"GET /health HTTP/1.1\r\nhost: soak\r\nconnection: Upgrade, HTTP2-Settings\r\n"
               b"upgrade: h2c\r\nhttp2-settings: AAMAAABk\r\n\r\n")
_ERROR_CODE = re.compile(rb'"code":\s*"(\w+)"')


async def _pause(stop: trio.Event, seconds: float) -> None:
    with trio.move_on_after(seconds):
        await stop.wait()


def _rounds(plan, stop: trio.Event):
    """A mode's loop: at most `plan.max_rounds` turns, none once `stop` is set."""
    for turn in range(plan.max_rounds):
        if stop.is_set():
            return
        yield turn


def _unexpected(tally: Tally, what: str, answer: bytes, closed: bool) -> None:
    status = status_of(answer)
    got = f"{status} {error_of(answer).get('code')}" if status else (
        "closed without an answer" if closed else "no answer")
    tally.outcomes[f"unexpected: {what} got {got}"] += 1


def _drain(sock) -> tuple[bytes, bool]:
    """What is already there to read on a connection, and whether the daemon closed it;
    without waiting."""
    received = b""
    try:
        while chunk := os.read(sock.fileno(), 65536):
            received += chunk
    except BlockingIOError:
        return received, False
    except OSError:
        pass
    return received, True


def _completion(plan, *, max_tokens: int = 4, stream: bool = False) -> bytes:
    return json.dumps({"model": plan.http_model, "prompt": f"{PROMPT_MARK} web stranger",
                       "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}).encode()


# -- the modes ---------------------------------------------------------------------------------


async def http_flood(listen: str, plan, tally: Tally, stop: trio.Event) -> None:
    """Open twice the front's connection cap at once: half send nothing, half one keep-alive
    `GET /health` and then nothing. Hold them all, count those the daemon closed (idle ones go
    first at the cap, and at the keep-alive timeout), let go, again."""
    for _ in _rounds(plan, stop):
        socks = []
        try:
            for i in range(plan.http_flood_connections):
                try:
                    sock = await connect(plan.http)
                except OSError as exc:
                    tally.outcomes[f"connect failed: {exc.strerror}"] += 1
                    continue
                socks.append(sock)
                tally.connections += 1
                if i % 2 and await send_all(sock, request("GET", "/health", key=plan.http_key,
                                                          close=False)):
                    tally.frames_sent += 1
            await _pause(stop, plan.hold_seconds)
            for i, sock in enumerate(socks):
                answer, closed = _drain(sock)
                asked = "asked /health" if i % 2 else "silent"
                if i % 2:
                    tally.outcomes[f"{asked}: answered 200" if answer.startswith(
                        b"HTTP/1.1 200") else f"{asked}: no answer within the hold"] += 1
                # one the kernel holds for the front to accept (at the cap, or past the
                # listen backlog) is open to this side, and may still be when the hold ends
                tally.outcomes[f"{asked}: closed by the daemon" if closed
                               else f"{asked}: open at the end of the hold"] += 1
        finally:
            for sock in socks:
                sock.close()
        await _pause(stop, 1.0)


async def http_trickle(listen: str, plan, tally: Tally, stop: trio.Event) -> None:
    """Announce a completion's body, then send it a byte every half second: the front reads
    at most its share of bodies at once (429 past it) and gives up on one at its
    `read_timeout` (408)."""
    body = _completion(plan)
    for _ in _rounds(plan, stop):
        sock = await connect(plan.http)
        tally.connections += 1
        try:
            answer, closed = b"", False
            if await send_all(sock, request("POST", "/v1/completions",
                                            key=plan.http_trickle_key, length=len(body))):
                for i in range(len(body) - 1):  # never the last byte
                    if stop.is_set() or not await send_all(sock, body[i:i + 1]):
                        break
                    tally.frames_sent += 1
                    answer, closed = await read_to_close(sock, 0.5)
                    if answer or closed:
                        break
                if answer and not closed:  # the rest of the answer
                    rest, closed = await read_to_close(sock, 1.0)
                    answer += rest
            status = status_of(answer)
            if status in (408, 429):
                tally.rejected[f"{status}/{error_of(answer).get('code')}"] += 1
            elif answer or closed:
                _unexpected(tally, "a trickled body", answer, closed)
            elif not stop.is_set():
                tally.outcomes["body sent whole but the last byte, no answer"] += 1
        finally:
            sock.close()
        await _pause(stop, 0.5)


async def http_non_reader(listen: str, plan, tally: Tally, stop: trio.Event) -> None:
    """Ask for a long streamed completion on a connection with a 4 KiB receive buffer and read
    nothing for a while; then read what came, to see how the daemon ended it."""
    for _ in _rounds(plan, stop):
        sock = await connect(plan.http, rcvbuf=4096)
        tally.connections += 1
        try:
            body = _completion(plan, max_tokens=plan.max_tokens, stream=True)
            if not await send_all(sock, request("POST", "/v1/completions", body,
                                                key=plan.http_key)):
                tally.outcomes["closed before the request was sent"] += 1
                continue
            tally.frames_sent += 1
            await _pause(stop, plan.hold_seconds)
            answer, closed = await read_to_close(sock, 2.0, limit=8 << 20)
            status = status_of(answer)
            if status == 200:
                tally.accepted += 1
                codes = _ERROR_CODE.findall(answer[-4096:])
                # paused past `pause_timeout` it ends `timeout`; a write stalled past the
                # front's `send_timeout` ends it as gone, and the connection is closed
                tally.finished["error event: " + codes[-1].decode() if codes
                               else "done" if b"data: [DONE]" in answer
                               else "connection closed mid-stream" if closed
                               else "still streaming after the hold"] += 1
            elif status == 429:
                tally.rejected[f"429/{error_of(answer).get('code')}"] += 1
            else:
                _unexpected(tally, "a streamed completion", answer, closed)
        finally:
            sock.close()
        await _pause(stop, 0.5)


async def http_h2c(listen: str, plan, tally: Tally, stop: trio.Event) -> None:
    """In turn: the HTTP/2 preface with prior knowledge (505, the connection closed), and an
    `Upgrade: h2c` (ignored: answered in HTTP/1.1)."""
    upgrade = H2C_UPGRADE.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")
    for turn in _rounds(plan, stop):
        prior = turn % 2 == 0
        answer, closed = await exchange(plan.http, H2_PREFACE if prior else upgrade, 5.0)
        tally.connections += 1
        tally.frames_sent += 1
        if prior and answer.startswith(b"HTTP/1.1 505") and closed:
            tally.rejected["505/http_version_not_supported"] += 1
        elif not prior and answer.startswith((b"HTTP/1.1 200", b"HTTP/1.1 503")):
            # 503: /health while a fault has the worker down, in HTTP/1.1 all the same
            tally.outcomes["upgrade ignored, answered in HTTP/1.1"] += 1
        else:
            _unexpected(tally, "HTTP/2 prior knowledge" if prior else "an h2c upgrade",
                        answer, closed)
        await _pause(stop, 0.5)


def _oversize(plan) -> list[tuple[str, bytes, tuple[int, ...]]]:
    """(what, the bytes, the statuses the README promises)."""
    line = b"GET /health?" + b"a" * 20_000 + b" HTTP/1.1\r\nhost: soak\r\nconnection: close\r\n\r\n"
    headers = (b"GET /health HTTP/1.1\r\nhost: soak\r\n" + b"x-padding: " + b"b" * 30_000
               + b"\r\nconnection: close\r\n\r\n")
    body = request("POST", "/v1/completions", key=plan.http_key, length=8 << 20)
    return [("a 20 KB request line", line, (414, 431)), ("30 KB of headers", headers, (431,)),
            ("an 8 MiB content-length", body, (413,))]


async def _refusals(plan, tally: Tally, stop: trio.Event,
                    cases: list[tuple[str, bytes, tuple[int, ...], str | None]]) -> None:
    """Send each case on a fresh connection in turn, twice a second: the status must be one
    of those given, and the error's `param` the one given (when one is)."""
    for turn in _rounds(plan, stop):
        what, data, statuses, param = cases[turn % len(cases)]
        answer, closed = await exchange(plan.http, data, 10.0)
        tally.connections += 1
        tally.frames_sent += 1
        status, error = status_of(answer), error_of(answer)
        if status in statuses and (param is None or error.get("param") == param):
            tally.rejected[f"{status}/{what}"] += 1
        else:
            _unexpected(tally, what, answer, closed)
        await _pause(stop, 0.5)


async def http_oversize(listen: str, plan, tally: Tally, stop: trio.Event) -> None:
    """An oversize request line, oversize headers, a body announced past `max_body_bytes`."""
    await _refusals(plan, tally, stop, [(*case, None) for case in _oversize(plan)])


def _bad_json(plan) -> list[tuple[str, bytes]]:
    head = b'{"model": ' + json.dumps(plan.http_model).encode() + b', "prompt": "x", '
    return [("a 5000-digit integer", head + b'"max_tokens": 1' + b"9" * 5000 + b"}"),
            ("nesting 100k deep", head + b'"stop": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
            ("NaN", head + b'"temperature": NaN}'), ("Infinity", head + b'"top_p": Infinity}'),
            ("a lone surrogate", head + b'"user": "\\ud800"}'),
            ("bytes not UTF-8", head + b'"user": "\xff\xfe"}'),
            ("a truncated body", head + b'"max_tokens": '), ("an array", b"[1, 2]"),
            ("an empty body", b"")]


async def http_bad_json(listen: str, plan, tally: Tally, stop: trio.Event) -> None:
    """Bodies that are not JSON the front takes: 400 each, and the connection serves on."""
    await _refusals(plan, tally, stop, [
        (what, request("POST", "/v1/completions", body, key=plan.http_key), (400,), None)
        for what, body in _bad_json(plan)])


def _bad_values(plan) -> list[tuple[str, dict, tuple[int, ...], str | None]]:
    return [("seed 2**64", {"seed": 2**64}, (400,), "seed"),
            ("max_tokens -1", {"max_tokens": -1}, (400,), "max_tokens"),
            ("top_k 2**63", {"top_k": 2**63}, (400,), "top_k"),
            ("priority -2**64", {"priority": -2**64}, (400,), "priority"),
            ("temperature 'hot'", {"temperature": "hot"}, (400,), "temperature"),
            ("n 9", {"n": 9}, (400,), "n"), ("tools", {"tools": []}, (400,), "tools"),
            ("17 stop strings", {"stop": [f"s{i}" for i in range(17)]}, (400,), "stop"),
            ("prompt 7", {"prompt": 7}, (400,), "prompt"),
            ("an unknown model", {"model": "no-such-model"}, (404,), "model")]


async def http_bad_values(listen: str, plan, tally: Tally, stop: trio.Event) -> None:
    """JSON bodies with values no parameter takes: 400 (404 for a model not served) with
    `param` naming the parameter."""
    base = json.loads(_completion(plan))
    await _refusals(plan, tally, stop, [
        (what, request("POST", "/v1/completions", json.dumps({**base, **change}).encode(),
                       key=plan.http_key), statuses, param)
        for what, change, statuses, param in _bad_values(plan)])


Mode = Callable[..., Awaitable[None]]

HTTP_MODES: dict[str, Mode] = {
    "http_flood": http_flood, "http_trickle": http_trickle, "http_non_reader": http_non_reader,
    "http_h2c": http_h2c, "http_oversize": http_oversize, "http_bad_json": http_bad_json,
    "http_bad_values": http_bad_values,
}
