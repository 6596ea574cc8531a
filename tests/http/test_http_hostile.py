"""Hostile HTTP clients against a live daemon's OpenAI-compatible front: each one costs only
itself. Connections past the fd limit, HTTP/2 streams on a shut window, bodies trickled by
one tenant and oversized request lines leave the daemon serving everyone else.

The fixtures check the KV invariant after each test.
"""

from __future__ import annotations

import json
import os
import resource
import select
import socket
import subprocess

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
import trio

from sluice.actors.runtime import messages as am
from sluice.ipc import messages as m
from sluice.ipc.control import fetch_status, send_command

HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
LAST_HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
# an HTTP/1.1 request asking to switch to HTTP/2 (h2c), its settings in base64
H2C_UPGRADE = (b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: Upgrade, HTTP2-Settings\r\n"
               b"upgrade: h2c\r\nhttp2-settings: AAMAAABk\r\n\r\n")


async def http_daemon(null_daemon, **overrides):
    handle = await null_daemon(**{"http.listen": "127.0.0.1:0", **overrides})
    handle.http = handle.daemon.http_address
    return handle


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def read_to_close(sock: socket.socket) -> bytes:
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


def exchange(address: str, data: bytes) -> bytes:
    """Send `data` on a fresh connection, then read until the server closes it."""
    with connect(address) as sock:
        sock.sendall(data)
        return read_to_close(sock)


def read_response(sock: socket.socket) -> bytes:
    """One response with a `content-length`, on a connection left open."""
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(65536)
    head, _, body = answer.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def readable(sock: socket.socket) -> bool:
    """Whether the server said something (or closed) on `sock` by now."""
    return bool(select.select([sock], [], [], 0)[0])


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def completion(model: str, *, key: str = "", stream: bool = False, cut: int | None = None,
               close: bool = False) -> bytes:
    """A completions request; `cut`: only that many bytes of its body (the rest never comes)."""
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 4000 if stream else 4,
                       "ignore_eos": True, "stream": stream}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + (f"authorization: Bearer {key}\r\n".encode() if key else b"")
            + (b"connection: close\r\n" if close else b"")
            + b"content-length: %d\r\n\r\n" % len(body))
    return head + (body if cut is None else body[:cut])


async def answering(handle) -> int:
    """Requests the HTTP front holds (bodies being read and generations), asked by message."""
    daemon = handle.daemon
    live = await daemon.questions.ask(daemon.http.inbox, lambda address, token: am.Ask(
        am.ListConnections(), address, token))
    return live.answering


async def answering_is(handle, count: int) -> bool:
    return await answering(handle) == count


async def until(check, timeout: float = 20.0) -> None:
    """Wait until the async `check()` holds."""
    with trio.fail_after(timeout):
        while not await check():
            await trio.sleep(0.02)


async def model_of(address: str, key: str = "") -> str:
    auth = f"authorization: Bearer {key}\r\n".encode() if key else b""
    answer = await trio.to_thread.run_sync(
        exchange, address,
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\n" + auth + b"connection: close\r\n\r\n")
    return json.loads(answer.partition(b"\r\n\r\n")[2])["data"][0]["id"]


def shut_window_h2() -> h2.connection.H2Connection:
    """The client side of an HTTP/2 connection (prior knowledge, h2c) that grants the server
    no window: a response's headers can reach it, not a byte of its body."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=True, header_encoding=None))
    connection.local_settings = h2.settings.Settings(client=True, initial_values={
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    connection.initiate_connection()
    return connection


def streamed_completions(connection: h2.connection.H2Connection, model: str,
                         streams: int) -> bytes:
    """What opens `streams` streamed completions on `connection` (the preface first, if it
    was not sent yet)."""
    body = json.dumps({"model": model, "prompt": "hi", "max_tokens": 4000,
                       "ignore_eos": True, "stream": True}).encode()
    for _ in range(streams):
        stream_id = connection.get_next_available_stream_id()
        connection.send_headers(stream_id, [
            (b":method", b"POST"), (b":path", b"/v1/completions"), (b":scheme", b"http"),
            (b":authority", b"x"), (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body))])
        connection.send_data(stream_id, body, end_stream=True)
    return connection.data_to_send()


class H2Client:
    """A socket speaking HTTP/2 with prior knowledge on a shut window (`shut_window_h2`)."""

    def __init__(self, address: str):
        self.sock = connect(address)
        self.h2 = shut_window_h2()
        self.statuses: list[int] = []  # of the responses begun
        self.reset: list[int] = []  # streams the server reset

    def open(self, model: str, streams: int) -> None:
        self.sock.sendall(streamed_completions(self.h2, model, streams))

    def read_until(self, done) -> None:
        """Read the server's frames until `done()`."""
        while not done():
            data = self.sock.recv(65536)
            assert data, "the server closed the connection"
            for event in self.h2.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    self.statuses.append(int(dict(event.headers)[b":status"]))
                elif isinstance(event, h2.events.StreamReset):
                    self.reset.append(event.stream_id)


async def test_a_request_line_over_the_header_limit_is_refused(null_daemon) -> None:
    handle = await http_daemon(null_daemon)  # http.max_header_bytes: 16 KiB
    line = b"GET /health?" + b"a" * 20_000 + b" HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
    with trio.fail_after(30):
        # parsed whole (it arrived in one read), or refused while it is being buffered
        for end in (b"\r\n", b""):
            answer = await trio.to_thread.run_sync(exchange, handle.http, line + end)
            assert status_of(answer) in (414, 431), answer[:200]
        answer = await trio.to_thread.run_sync(exchange, handle.http, line + b"\r\n")
        assert b"http.max_header_bytes" in answer
        # a request line and headers that are each under the limit, but not together
        headers = b"x-padding: " + b"b" * 10_000 + b"\r\n"
        answer = await trio.to_thread.run_sync(
            exchange, handle.http, b"GET /health?" + b"a" * 8_000 + b" HTTP/1.1\r\nhost: x\r\n"
            + headers + b"connection: close\r\n\r\n")
        assert status_of(answer) == 431, answer[:200]
        answer = await trio.to_thread.run_sync(exchange, handle.http, LAST_HEALTH)
        assert status_of(answer) == 200


async def test_h2c_is_answered_in_http1_unless_http2_is_configured(null_daemon) -> None:
    # three connections of 100 streams on a shut window once pinned every slot here
    handle = await http_daemon(null_daemon, **{"http.max_concurrent_requests": 8})
    model = await model_of(handle.http)
    with trio.fail_after(30):
        attackers = [H2Client(handle.http) for _ in range(3)]
        try:
            for attacker in attackers:
                attacker.open(model, 100)
            for attacker in attackers:  # the preface is refused and the connection closed
                answer = await trio.to_thread.run_sync(read_to_close, attacker.sock)
                assert answer.startswith(b"HTTP/1.1 505"), answer[:100]
                assert b"http.http2" in answer
            # an Upgrade to h2c is ignored: the request is answered in HTTP/1.1
            answer = await trio.to_thread.run_sync(
                exchange, handle.http,
                H2C_UPGRADE.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n"))
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"serving\n"), answer
            assert await answering(handle) == 0
            answer = await trio.to_thread.run_sync(exchange, handle.http,
                                                   completion(model, close=True))
            assert status_of(answer) == 200
            assert json.loads(answer.partition(b"\r\n\r\n")[2])["choices"][0]["text"] == (
                " the quick brown fox")
        finally:
            for attacker in attackers:
                attacker.sock.close()


async def test_with_http2_a_stream_on_a_shut_window_frees_its_slot_at_the_write_deadline(
        null_daemon) -> None:
    handle = await http_daemon(null_daemon, **{
        "http.http2": True, "http.send_timeout": 1.0, "http.max_concurrent_requests": 4,
        "stream.pause_timeout": 60.0})
    model = await model_of(handle.http)
    attacker = H2Client(handle.http)
    try:
        with trio.fail_after(30):
            attacker.open(model, 4)
            # HTTP/2 is spoken: the responses begin, but no body can be written. Each stream's
            # write gives up at the deadline, and the stream is reset, its request cancelled
            # and its slot freed, though the connection stays open
            await trio.to_thread.run_sync(attacker.read_until, lambda: len(attacker.reset) == 4)
            assert attacker.statuses == [200] * 4
            await until(lambda: answering_is(handle, 0))
            report = await fetch_status(handle.control)
            assert report.requests.running + report.requests.paused == 0
            snapshot = await send_command(handle.control, m.Subscribe(ttl=1.0))
            assert snapshot.detail.ended.get("cancelled") == 4, snapshot.detail.ended
            answer = await trio.to_thread.run_sync(exchange, handle.http,
                                                   completion(model, close=True))
            assert status_of(answer) == 200
    finally:
        attacker.sock.close()


async def test_bodies_trickled_by_one_tenant_leave_another_tenant_served(null_daemon) -> None:
    handle = await http_daemon(null_daemon, **{
        "http.tenants": {"a": ["key-a"], "b": ["key-b"]},
        "http.max_concurrent_requests": 2, "http.max_body_reads": 4})  # tenant_share: 0.5
    model = await model_of(handle.http, "key-b")
    trickling: list[socket.socket] = []
    refusals: list[bytes] = []
    try:
        with trio.fail_after(30):
            # tenant a starts six bodies that never finish: it is read at most its share of
            # http.max_body_reads at once, and the others are refused at once
            for _ in range(6):
                sock = connect(handle.http)
                sock.sendall(completion(model, key="key-a", cut=10))
                held = len(trickling)

                async def heard(sock=sock, held=held) -> bool:
                    return readable(sock) or await answering(handle) > held

                await until(heard)
                if readable(sock):
                    refusals.append(await trio.to_thread.run_sync(read_to_close, sock))
                    sock.close()
                else:
                    trickling.append(sock)
            assert len(trickling) == 2, refusals
            for answer in refusals:
                assert status_of(answer) == 429 and b"http.tenant_share" in answer, answer
            # and they hold none of the http.max_concurrent_requests: tenant b is served
            answer = await trio.to_thread.run_sync(
                exchange, handle.http, completion(model, key="key-b", close=True))
            assert status_of(answer) == 200, answer
            for sock in trickling:
                sock.close()
            await until(lambda: answering_is(handle, 0))

            # a tenant holds at most its share of the generations too
            with connect(handle.http) as held:
                held.sendall(completion(model, key="key-a", stream=True))
                await until(lambda: answering_is(handle, 1))
                answer = await trio.to_thread.run_sync(
                    exchange, handle.http, completion(model, key="key-a", close=True))
                assert status_of(answer) == 429 and b"http.tenant_share" in answer, answer
                answer = await trio.to_thread.run_sync(
                    exchange, handle.http, completion(model, key="key-b", close=True))
                assert status_of(answer) == 200, answer
            await until(lambda: answering_is(handle, 0))
    finally:
        for sock in trickling:
            sock.close()


async def test_at_the_connection_cap_idle_connections_go_first(null_daemon) -> None:
    handle = await http_daemon(null_daemon, **{"http.max_connections": 4})
    model = await model_of(handle.http)
    front = handle.daemon.http
    with trio.fail_after(30):
        # four keep-alive connections, idle after a request each, the oldest first
        idle = [connect(handle.http) for _ in range(4)]
        try:
            for sock in idle:
                sock.sendall(HEALTH)
                assert status_of(await trio.to_thread.run_sync(read_response, sock)) == 200
            # a fifth is served: the connection idle longest was closed to make room
            answer = await trio.to_thread.run_sync(exchange, handle.http, LAST_HEALTH)
            assert status_of(answer) == 200
            assert await trio.to_thread.run_sync(idle[0].recv, 1) == b""
            assert not readable(idle[-1])  # the one idle the shortest is still open
        finally:
            for sock in idle:
                sock.close()
        await until(lambda: _connections_are(front, 0))

        # four connections busy with a request each: the fifth waits until one goes
        busy = [connect(handle.http) for _ in range(4)]
        try:
            for sock in busy:
                sock.sendall(completion(model, stream=True))
            await until(lambda: answering_is(handle, 4))
            with connect(handle.http) as waiting:  # queued by the kernel, not accepted
                waiting.sendall(LAST_HEALTH)
                assert len(front.connections) == 4 and not readable(waiting)
                busy.pop(0).close()  # its request is cancelled, its connection closed
                answer = await trio.to_thread.run_sync(read_to_close, waiting)
                assert status_of(answer) == 200
        finally:
            for sock in busy:
                sock.close()
        await until(lambda: answering_is(handle, 0))


async def _connections_are(front, count: int) -> bool:
    return len(front.connections) == count


# -- thousands of connections against a daemon with 2,048 descriptors -------------------------

DAEMON_FDS = 2048
ATTACK = 3000


def attack(address: str, model: str) -> list[socket.socket]:
    """ATTACK connections: silent ones, keep-alive ones that read no answer, HTTP/2 prefaces
    on a shut window, and h2c upgrades."""
    kinds = [b"", HEALTH, None, H2C_UPGRADE]
    socks = []
    try:
        for i in range(ATTACK):
            sock = connect(address)
            socks.append(sock)
            data = kinds[i % len(kinds)]
            if data is None:
                data = streamed_completions(shut_window_h2(), model, 3)
            if data:
                try:
                    sock.sendall(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # closed already, to make room
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def fds_for_the_attack():
    """This process's soft fd limit raised for the attack."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = ATTACK + 500
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the fd limit ({hard}) leaves no room for {ATTACK} connections")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def fd_limited(sluiced, limit: int, args: list[str], **kwargs):
    """`sluiced(args)` in a process whose fd limit is `limit`, soft and hard, from its start
    (the daemon raises its soft limit to the hard one)."""
    popen = subprocess.Popen

    def limited(*popen_args, **popen_kwargs):
        return popen(*popen_args, **popen_kwargs, preexec_fn=lambda: resource.setrlimit(
            resource.RLIMIT_NOFILE, (limit, limit)))

    subprocess.Popen = limited
    try:
        return sluiced(args, **kwargs)
    finally:
        subprocess.Popen = popen


async def test_thousands_of_connections_cannot_take_the_daemon_s_descriptors(
        tmp_path, sluiced, fds_for_the_attack) -> None:
    process, fields = fd_limited(
        sluiced, DAEMON_FDS,
        ["--executor", "null", "--listen", "tcp://127.0.0.1:0", "--http", "127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock"], log=tmp_path / "sluiced.log",
        log_level="warning")
    assert resource.prlimit(process.pid, resource.RLIMIT_NOFILE) == (DAEMON_FDS, DAEMON_FDS)
    address, control = fields["http"], fields["control"]
    baseline = open_fds(process.pid)
    model = await model_of(address)
    with trio.fail_after(50):
        socks = await trio.to_thread.run_sync(attack, address, model)
        try:
            assert process.poll() is None, "the daemon died"
            # the front stopped short of the limit, with room to spare for everything else
            assert open_fds(process.pid) < DAEMON_FDS - 128
            report = await fetch_status(control)
            assert report.requests.running + report.requests.paused == 0
            # a well-behaved client is served meanwhile
            answer = await trio.to_thread.run_sync(exchange, address,
                                                   completion(model, close=True))
            assert status_of(answer) == 200, answer[:200]
            assert json.loads(answer.partition(b"\r\n\r\n")[2])["choices"][0]["text"] == (
                " the quick brown fox")
        finally:
            for sock in socks:
                sock.close()

        async def released() -> bool:  # nothing of the attack is held once it is gone
            return open_fds(process.pid) <= baseline + 8

        await until(released, timeout=30)
        assert process.poll() is None, "the daemon died"
    assert "no descriptor left" not in (tmp_path / "sluiced.log").read_text()
