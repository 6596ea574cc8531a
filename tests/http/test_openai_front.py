"""The OpenAI-compatible HTTP front through a live daemon on the null executor, driven by the
official `openai` package (and raw HTTP where the package would hide what is asserted).

The null executor generates the token cycle of `NullSettings.text` (" the quick brown fox
jumps over the lazy dog"), so the text a request gets is known. The `null_daemon` fixture
checks the KV invariant after each test.
"""

from __future__ import annotations

import http.client
import json
import socket
import time

import openai
import pytest
import trio

from sluice.actors.runtime import messages as am
from sluice.actors.front.stream import Stream
from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status, send_command

CYCLE = " the quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


async def http_daemon(null_daemon, **overrides):
    handle = await null_daemon(**{"http.listen": "127.0.0.1:0", **overrides})
    handle.http = handle.daemon.http_address
    return handle


def sdk(handle, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{handle.http}/v1", api_key=key, max_retries=0,
                         timeout=30)


async def call(fn, *args, **kwargs):
    """The SDK is synchronous and the daemon runs on this test's event loop: a thread."""
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


async def raw(handle, method: str, path: str, body=None,
              headers: dict | None = None) -> tuple[int, dict[str, str], bytes]:
    """One plain HTTP request: (status, headers, body)."""
    def exchange():
        host, port = handle.http.rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            connection.close()

    return await trio.to_thread.run_sync(exchange)


def plain_exchange(handle, data: bytes) -> bytes:
    """Send `data` on a fresh connection, then read until the server closes it."""
    host, port = handle.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


async def model_name(client: openai.OpenAI) -> str:
    models = await call(client.models.list)
    return models.data[0].id


async def refused(fn, **kwargs) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        await call(fn, **kwargs)
    error = caught.value.body
    assert set(error) == {"message", "type", "param", "code"}, error  # OpenAI's error shape
    return caught.value


async def test_chat_and_completions_streamed_and_not(null_daemon) -> None:
    handle = await http_daemon(null_daemon)
    client = sdk(handle)
    with trio.fail_after(60):
        model = await model_name(client)
        chat = await call(client.chat.completions.create, model=model, messages=MESSAGES,
                          max_tokens=5)
        assert chat.choices[0].message.content == " the quick brown fox jumps"
        assert chat.choices[0].finish_reason == "length"
        # the ZeroMQ front counts the same prompt the same way
        async with AsyncClient(handle.listen) as native:
            same = await (await native.generate(messages=MESSAGES, max_tokens=5)).collect()
        assert chat.usage.prompt_tokens == same.usage.prompt_tokens > 0
        assert chat.usage.completion_tokens == 5
        assert chat.usage.total_tokens == chat.usage.prompt_tokens + 5
        # the first request found nothing cached; the prompt's full blocks are cached now
        assert chat.usage.prompt_tokens_details.cached_tokens == 0
        assert same.usage.cached_tokens > 0

        events = await call(lambda: list(client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=5, stream=True,
            stream_options={"include_usage": True})))
        assert events[0].choices[0].delta.role == "assistant"
        text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
        assert text == " the quick brown fox jumps"
        assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
        assert events[-1].choices == [] and events[-1].usage.completion_tokens == 5
        assert events[-1].usage.prompt_tokens == chat.usage.prompt_tokens
        assert events[-1].usage.prompt_tokens_details.cached_tokens == same.usage.cached_tokens

        done = await call(client.completions.create, model=model, prompt="Once upon",
                          max_tokens=3)
        assert (done.choices[0].text, done.choices[0].finish_reason) == (" the quick brown",
                                                                         "length")
        assert (done.usage.completion_tokens, done.usage.total_tokens) == (
            3, done.usage.prompt_tokens + 3)
        streamed = await call(lambda: list(client.completions.create(
            model=model, prompt="Once upon", max_tokens=3, stream=True)))
        assert "".join(e.choices[0].text for e in streamed) == " the quick brown"
        assert streamed[-1].choices[0].finish_reason == "length"
        assert all(e.usage is None for e in streamed)  # only asked for with include_usage

        ids = await call(client.completions.create, model=model, prompt=[1, 504, 3458],
                         max_tokens=2)
        assert ids.choices[0].text == " the quick" and ids.usage.prompt_tokens == 3


async def test_a_stream_flows_when_the_daemon_clamps_credits_below_the_front_s_window(
        null_daemon) -> None:
    # the front grants in batches of half its window; were the window left above the clamp,
    # no batch would ever fill and the response would stall after its first chunks
    handle = await http_daemon(null_daemon, **{"limits.max_credits": 2})
    client = sdk(handle)
    with trio.fail_after(60):
        model = await model_name(client)
        events = await call(lambda: list(client.completions.create(
            model=model, prompt="Once upon", max_tokens=30, stream=True)))
        text = "".join(e.choices[0].text for e in events)
        assert text == "".join(f" {word}" for word in (CYCLE.split() * 4)[:30])
        assert events[-1].choices[0].finish_reason == "length"


async def test_logprobs_travel_with_their_tokens_streamed_and_not(null_daemon) -> None:
    """The null executor's tokens are certain: each logprob is 0 and its one alternative is
    itself; what is asserted is that each token's entry arrives, in OpenAI's shape, named by
    its own text."""
    handle = await http_daemon(null_daemon)
    client = sdk(handle)
    words = [" the", " quick", " brown", " fox"]
    with trio.fail_after(60):
        model = await model_name(client)
        chat = await call(client.chat.completions.create, model=model, messages=MESSAGES,
                          max_tokens=4, logprobs=True, top_logprobs=2)
        content = chat.choices[0].logprobs.content
        assert [t.token for t in content] == words
        assert [t.logprob for t in content] == [0.0] * 4
        assert content[1].bytes == list(b" quick")
        assert [[a.token for a in t.top_logprobs] for t in content] == [[w] for w in words]

        events = await call(lambda: list(client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=4, logprobs=True, stream=True)))
        streamed = [t for e in events if e.choices and e.choices[0].logprobs
                    for t in e.choices[0].logprobs.content]
        assert [t.token for t in streamed] == words
        assert all(t.top_logprobs == [] for t in streamed)  # top_logprobs: 0

        plain = await call(client.completions.create, model=model, prompt="Once",
                           max_tokens=3, logprobs=1)
        legacy = plain.choices[0].logprobs
        assert legacy.tokens == words[:3] and legacy.token_logprobs == [0.0] * 3
        assert legacy.text_offset == [0, 4, 10]
        assert legacy.top_logprobs == [{w: 0.0} for w in words[:3]]
        without = await call(client.completions.create, model=model, prompt="Once",
                             max_tokens=3)
        assert without.choices[0].logprobs is None
        async with AsyncClient(handle.listen) as native:  # the ZeroMQ front, the same entries
            done = await (await native.generate("Once", max_tokens=3, logprobs=True,
                                                top_logprobs=1)).collect()
        assert [(t.token, t.logprob) for t in done.logprobs] == [(w, 0.0) for w in words[:3]]
        assert [a.token_id for a in done.logprobs[0].top] == done.token_ids[:1]


async def test_stop_strings_and_parts(null_daemon) -> None:
    handle = await http_daemon(null_daemon)
    client = sdk(handle)
    with trio.fail_after(60):
        model = await model_name(client)
        stopped = await call(client.completions.create, model=model, prompt="Once",
                             max_tokens=20, stop=[" fox", "zebra"])
        assert stopped.choices[0].text == " the quick brown"  # the stop string is not sent
        assert stopped.choices[0].finish_reason == "stop"
        streamed = await call(lambda: list(client.chat.completions.create(
            model=model, max_tokens=20, stop=" jumps", stream=True,
            messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                   {"type": "text", "text": " there"}]}])))
        text = "".join(e.choices[0].delta.content or "" for e in streamed)
        assert text == " the quick brown fox"
        assert streamed[-1].choices[0].finish_reason == "stop"


async def test_each_refusal_has_its_status_and_names_its_parameter(null_daemon) -> None:
    handle = await http_daemon(null_daemon, **{"limits.max_stop_strings": 2})
    client = sdk(handle)
    chat, completions = client.chat.completions.create, client.completions.create
    with trio.fail_after(60):
        model = await model_name(client)
        refusals = [
            (dict(temperature=-1), "temperature"),
            (dict(top_p=0), "top_p"),
            (dict(max_tokens=0), "max_tokens"),
            (dict(n=1000), "n"),
            (dict(top_logprobs=2), "top_logprobs"),
            (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
            (dict(response_format={"type": "xml"}), "response_format.type"),
            (dict(tools=[{"type": "function", "function": {"name": "f g"}}]),
             "tools[0].function.name"),
            (dict(stop=["a", "b", "c"]), "stop"),
            (dict(extra_body={"frobnicate": 1}), "frobnicate"),
        ]
        for params, name in refusals:
            error = await refused(chat, model=model, messages=MESSAGES, **params)
            assert (error.status_code, error.body["param"]) == (400, name), (params, error.body)
            assert error.body["type"] == "invalid_request_error"
        for params, name in [(dict(echo=True), "echo"), (dict(best_of=2), "best_of"),
                             (dict(logprobs=21), "logprobs")]:
            error = await refused(completions, model=model, prompt="hi", **params)
            assert (error.status_code, error.body["param"]) == (400, name)
        image = [{"role": "user", "content": [{"type": "image_url",
                                                "image_url": {"url": "http://x/y.png"}}]}]
        error = await refused(chat, model=model, messages=image)
        assert (error.status_code, error.body["param"]) == (400, "messages[0].content[0]")

        error = await refused(chat, model="gpt-4o", messages=MESSAGES)
        assert (error.status_code, error.body["param"]) == (404, "model")
        too_long = await refused(completions, model=model, prompt=[1] * 4096, max_tokens=1)
        assert too_long.status_code == 400
        assert too_long.body["code"] == "context_length_exceeded"
        assert too_long.body["param"] == "prompt"
        vocabulary = await refused(completions, model=model, prompt=[10 ** 9], max_tokens=1)
        assert (vocabulary.status_code, vocabulary.body["param"]) == (400, "prompt")


async def test_quota_overload_and_drain_say_when_to_retry(null_daemon) -> None:
    handle = await http_daemon(null_daemon, **{
        "http.max_concurrent_requests": 1, "http.retry_after": 7,
        "http.tenants": {"default": ["key-default"], "batch": ["key-batch"]},
        "scheduler": {"tenants": {"batch": {"max_queued": 0}}}})
    client = sdk(handle, "key-default")
    with trio.fail_after(60):
        model = await model_name(client)
        quota = await refused(sdk(handle, "key-batch").completions.create, model=model,
                              prompt="hi", max_tokens=2)
        assert (quota.status_code, quota.response.headers["retry-after"]) == (429, "7")
        assert quota.body["type"] == "rate_limit_error"
        with held_stream(handle, model, key="key-default"):  # the one HTTP request allowed
            await wait_for(handle.control, lambda r: r.requests.running + r.requests.paused)
            busy = await refused(client.completions.create, model=model, prompt="hi",
                                 max_tokens=2)
            assert (busy.status_code, busy.response.headers["retry-after"]) == (429, "7")
            assert busy.body["code"] == "overloaded"
        reply = await send_command(handle.control, m.DrainCommand())
        assert reply.ok
        draining = await refused(client.completions.create, model=model, prompt="hi",
                                 max_tokens=2)
        assert (draining.status_code, draining.body["code"]) == (503, "draining")
        status, _, _ = await raw(handle, "GET", "/health")
        assert status == 503
        await send_command(handle.control, m.ResumeCommand())
        assert (await raw(handle, "GET", "/health"))[::2] == (200, b"serving\n")


async def test_bodies_over_the_limit_are_refused_before_they_are_read(null_daemon) -> None:
    handle = await http_daemon(null_daemon, **{"http.max_body_bytes": 1000})
    json_body = {"content-type": "application/json"}
    with trio.fail_after(30):
        status, _, body = await raw(handle, "POST", "/v1/completions",
                                    b"{" + b" " * 2000 + b"}", json_body)
        assert status == 413
        assert json.loads(body)["error"]["code"] == "request_too_large"
        # chunked: refused once past the limit, the rest never read (none is sent here, so
        # the server's close is not a reset that could hide its answer)
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        chunk = b"190\r\n" + b" " * 400 + b"\r\n"  # 0x190 = 400 bytes
        answer = await trio.to_thread.run_sync(plain_exchange, handle, head + chunk * 3)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:100]
        status, _, body = await raw(handle, "POST", "/v1/completions", b"{not json", json_body)
        assert status == 400 and json.loads(body)["error"]["param"] is None
        assert (await raw(handle, "GET", "/v1/completions"))[0] == 405
        assert (await raw(handle, "GET", "/v2/nothing"))[0] == 404


async def test_api_keys_choose_the_tenant(null_daemon) -> None:
    handle = await http_daemon(null_daemon, **{
        "http.tenants": {"interactive": ["key-interactive"], "batch": ["key-batch"]}})
    with trio.fail_after(60):
        model = await model_name(sdk(handle, "key-batch"))
        for key in ("key-interactive", "key-batch", "key-batch"):
            done = await call(sdk(handle, key).completions.create, model=model, prompt="hi",
                              max_tokens=2, user="interactive")  # `user` never picks a tenant
            assert done.choices[0].finish_reason == "length"
        snapshot = await send_command(handle.control, m.Subscribe(ttl=1.0))
        tenants = snapshot.detail.tenants
        assert tenants["interactive"].totals.finished == 1
        assert tenants["batch"].totals.finished == 2
        for key in ("wrong", "key-interactive-but-longer", "key-interactiv"):
            error = await refused(sdk(handle, key).completions.create, model=model,
                                  prompt="hi", max_tokens=2)
            assert (error.status_code, error.body["type"]) == (401, "authentication_error")
        body = json.dumps({"model": model, "prompt": "hi"}).encode()
        for headers in ({}, {"authorization": "Basic key-batch"},
                        {"authorization": "Bearer"}):
            status, _, answer = await raw(handle, "POST", "/v1/completions", body, headers)
            assert status == 401, headers
            assert json.loads(answer)["error"]["code"] == "invalid_api_key"


class held_stream:
    """A streamed request on a raw socket that reads nothing after the response head: its
    request stays live (it is paused when its chunks back up)."""

    def __init__(self, handle, model: str, max_tokens: int = 4000, key: str = ""):
        self.address = handle.http
        body = json.dumps({"model": model, "prompt": "hi", "max_tokens": max_tokens,
                           "ignore_eos": True, "stream": True}).encode()
        auth = f"authorization: Bearer {key}\r\n".encode() if key else b""
        self.request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" + auth
                        + b"content-type: application/json\r\n"
                        + b"content-length: %d\r\n\r\n" % len(body) + body)

    def __enter__(self) -> socket.socket:
        host, port = self.address.rsplit(":", 1)
        self.sock = socket.socket()
        # small buffers, so the kernel does not absorb what the client does not read
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect((host, int(port)))
        self.sock.sendall(self.request)
        return self.sock

    def __exit__(self, *exc) -> None:
        self.sock.close()


def events_until_error(sock: socket.socket, timeout: float = 10.0) -> list[dict]:
    """The server-sent events a held stream reads, up to and with the first error event."""
    sock.settimeout(timeout)
    data = b""
    while b"\n\n" not in data.partition(b'data: {"error"')[2]:
        try:
            more = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"no error event in {timeout} s: {data[-300:]!r}") from None
        assert more, f"the stream closed before an error event: {data[-300:]!r}"
        data += more
    events = []
    for line in data.split(b"\n"):
        if line.startswith(b"data: {"):
            events.append(json.loads(line[len(b"data: "):]))
            if "error" in events[-1]:
                return events
    raise AssertionError("no complete error event")


async def wait_for(control: str, check, timeout: float = 10.0) -> m.StatusReport:
    with trio.fail_after(timeout):
        while True:
            report = await fetch_status(control)
            if check(report):
                return report
            await trio.sleep(0.02)


async def test_a_client_that_disconnects_cancels_its_request(null_daemon) -> None:
    # no timeout of the daemon's could end the request within the test: only the disconnect
    handle = await http_daemon(null_daemon, **{"stream.heartbeat_timeout": 600.0,
                                               "stream.pause_timeout": 600.0})
    model = await model_name(sdk(handle))
    with held_stream(handle, model):
        await wait_for(handle.control, lambda r: r.requests.running + r.requests.paused == 1)
    # gone: its request ends cancelled and holds no block
    report = await wait_for(handle.control, lambda r: r.counters.cancelled == 1
                            and r.kv.used_blocks == 0)
    assert report.requests.running + report.requests.paused == 0


async def http_requests(handle) -> int:
    """Requests the HTTP front is answering, asked by message."""
    daemon = handle.daemon
    live = await daemon.questions.ask(daemon.http.inbox, lambda address, token: am.Ask(
        am.ListConnections(), address, token))
    return live.answering


async def test_a_crash_of_the_front_s_stream_ends_its_requests_and_the_front_serves_on(
        null_daemon, monkeypatch) -> None:
    handle = await http_daemon(null_daemon)
    client = sdk(handle)
    model = await model_name(client)

    async def crash(self, msg):
        raise RuntimeError("injected stream fault")

    # the HTTP requests share one Stream actor: a fault in it ends every request it holds
    monkeypatch.setattr(Stream, "on_cancel", crash)  # a disconnect sends Cancel: it crashes
    with held_stream(handle, model) as held, held_stream(handle, model) as bystander:
        await wait_for(handle.control, lambda r: r.requests.running + r.requests.paused == 2)
        bystander.close()
        # both end and hold no block ...
        await wait_for(handle.control, lambda r: r.requests.running + r.requests.paused == 0
                       and r.kv.used_blocks == 0)
        # ... and the one still connected reads, after its chunks, an error event
        events = await trio.to_thread.run_sync(events_until_error, held)
        assert events[-1]["error"]["type"] == "server_error", events[-1]
        assert all("choices" in event for event in events[:-1])
    daemon = handle.daemon
    assert not any(name.startswith("stream-") for name in daemon.supervisor.restarts)
    monkeypatch.undo()
    # a new stream serves the next requests
    for _ in range(3):
        answer = await call(client.completions.create, model=model, prompt="hi", max_tokens=4)
        assert answer.choices[0].finish_reason == "length"
        assert answer.choices[0].text == " the quick brown fox"


async def test_a_request_sent_to_a_stream_that_just_crashed_is_served_by_the_next(
        null_daemon, monkeypatch) -> None:
    # between a stream's crash and the front hearing of it, requests still go to the closed
    # stream, which refuses them unseen: the front sends such a request on to a new stream
    handle = await http_daemon(null_daemon)
    client = sdk(handle)
    model = await model_name(client)
    front = handle.daemon.http
    put, held, heard = front.inbox.put, [], trio.Event()

    def hold_the_news(msg) -> None:  # the crashed stream's word reaches the front late
        if isinstance(msg, am.StreamClosed) and not heard.is_set():
            held.append(msg)
            heard.set()
        else:
            put(msg)

    on_cancel = Stream.on_cancel
    crashed: list[Stream] = []

    async def crash_once(self, msg):
        if not crashed:
            crashed.append(self)
            raise RuntimeError("injected stream fault")
        await on_cancel(self, msg)

    monkeypatch.setattr(front.inbox, "put", hold_the_news)
    monkeypatch.setattr(Stream, "on_cancel", crash_once)  # a disconnect sends Cancel
    with trio.fail_after(60):
        with held_stream(handle, model):
            await wait_for(handle.control, lambda r: r.requests.running + r.requests.paused == 1)
        await heard.wait()  # the stream crashed and closed; the front has not heard yet
        assert front.stream is crashed[0] and crashed[0].closed
        answer = await call(client.completions.create, model=model, prompt="hi", max_tokens=4)
        assert (answer.choices[0].text, answer.choices[0].finish_reason) == (
            " the quick brown fox", "length")
        assert front.stream is not crashed[0]
        put(held.pop())
        await wait_for(handle.control, lambda r: r.requests.running + r.requests.paused == 0
                       and r.kv.used_blocks == 0)


async def test_a_reader_that_stops_reading_is_paused_then_timed_out(null_daemon) -> None:
    handle = await http_daemon(null_daemon, **{
        "stream.pause_timeout": 1.0, "stream.high_watermark": 4, "stream.low_watermark": 1,
        "null.max_model_len": 16384, "http.send_timeout": 3.0})
    model = await model_name(sdk(handle))
    with held_stream(handle, model, max_tokens=16000):
        paused = await wait_for(handle.control, lambda r: r.requests.paused == 1, timeout=20)
        assert paused.kv.used_blocks > 0  # a paused request keeps its KV
        await wait_for(handle.control, lambda r: r.requests.paused + r.requests.running == 0
                       and r.kv.used_blocks == 0, timeout=10)
        snapshot = await send_command(handle.control, m.Subscribe(ttl=1.0))
        assert snapshot.detail.ended.get("timeout") == 1, snapshot.detail.ended
        # the connection itself is dropped too, though the client never closes it
        with trio.fail_after(10):
            while await http_requests(handle):
                await trio.sleep(0.1)


async def test_a_request_cancelled_mid_stream_ends_with_an_error_event(null_daemon) -> None:
    handle = await http_daemon(null_daemon)
    client = sdk(handle)
    model = await model_name(client)
    seen: list = []

    def read_slowly():
        events = client.completions.create(model=model, prompt="hi", max_tokens=4000,
                                           stream=True, extra_body={"ignore_eos": True})
        try:
            for event in events:
                seen.append(event)
                time.sleep(0.01)
        except openai.APIError as error:
            return error
        return None

    async def cancel_it():
        await wait_for(handle.control, lambda r: r.requests.running + r.requests.paused == 1)
        snapshot = await send_command(handle.control, m.Subscribe(ttl=1.0))
        [row] = snapshot.detail.requests
        reply = await send_command(handle.control, m.CancelCommand(row.request_id))
        assert reply.ok, reply.message

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_it)
            ended = await trio.to_thread.run_sync(read_slowly)
    assert seen and seen[0].choices[0].text  # it was streaming when it was cancelled
    assert isinstance(ended, openai.APIError), ended
    assert ended.body["code"] == "cancelled"


async def test_slow_and_oversized_requests_lose_their_connection(null_daemon) -> None:
    handle = await http_daemon(null_daemon, **{
        "http.max_header_bytes": 4096, "http.read_timeout": 1.0,
        "http.keep_alive_timeout": 1.0})

    def exchange(data: bytes) -> bytes:
        return plain_exchange(handle, data)

    with trio.fail_after(30):
        huge = b"GET /health HTTP/1.1\r\nhost: x\r\nx-padding: " + b"a" * 5000
        for end in (b"\r\n\r\n", b""):  # parsed whole, or refused while it is buffered
            answer = await trio.to_thread.run_sync(exchange, huge + end)
            assert answer.startswith(b"HTTP/1.1 431"), (end, answer[:100])
        # a body that stops arriving: 408 after http.read_timeout
        slow = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n"
                b'{"model": ')
        answer = await trio.to_thread.run_sync(exchange, slow)
        assert answer.startswith(b"HTTP/1.1 408") and b"http.read_timeout" in answer
        # a connection that never sends a request is closed after the keep-alive timeout
        assert await trio.to_thread.run_sync(exchange, b"") == b""
        assert (await raw(handle, "GET", "/health"))[0] == 200  # and the front still serves


async def test_reconcile_leaves_a_streaming_http_request_alone(null_daemon) -> None:
    handle = await http_daemon(null_daemon)
    model = await model_name(sdk(handle))
    with held_stream(handle, model):
        await wait_for(handle.control, lambda r: r.requests.running + r.requests.paused == 1)
        reply = await send_command(handle.control, m.ReconcileCommand())
        assert reply.findings == (), reply.findings  # its connection is live: not an orphan
        report = await fetch_status(handle.control)
        assert report.requests.running + report.requests.paused == 1
