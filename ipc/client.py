"""The client library: `AsyncClient` (trio) and `Client` (blocking), the same shape.

    async with AsyncClient("tcp://127.0.0.1:7340") as client:
        generation = await client.generate("Hello", max_tokens=16, temperature=0)
        async for chunk in generation:
            print(chunk.text, end="")
        print(generation.result.finish_reason)

Credits are granted as the application consumes chunks, so an application that stops
reading becomes a slow client and the daemon pauses its request. A request's window is
`credit_window`, or the daemon's `max_credits` where that is smaller (a larger grant would be
clamped, and the top-up after half the window never come). Heartbeats run in the background.
A refusal raises the `RejectedError` subclass of its code. A request larger than the daemon's
frame limit is refused here, with `InvalidRequestError` naming the sizes: the daemon would
drop the connection unanswered. Both limits are learnt once per connection, from the daemon's
`ServerInfo`. Against a daemon with CURVE authentication, pass its public key and this
client's key pair (Z85 text, as `zmq.curve_keypair()` makes them):
`AsyncClient(address, curve_server_key=..., curve_keypair=(public, secret))`.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio
import zmq

from sluice.ipc import messages as m
from sluice.ipc.codec import Codec, CodecError
from sluice.ipc.errors import DaemonGone, error_for
from sluice.ipc.vocabulary import InvalidRequestError, SluiceError
from sluice.ipc.sockets import Socket
from sluice.ipc.vocabulary import InvalidParams, SamplingParams, choice_seed, grammar_of


_FRAMES_PER_TURN = 64  # frames the receive loop routes in one turn of the event loop, at most


@dataclass
class GenerationResult:
    request_id: str
    finish_reason: str  # stop | length | cancelled | timeout | error | preempted_abort
    text: str
    token_ids: list[int]
    usage: m.Usage
    timings: m.Timings
    error: str | None = None  # the daemon's message when finish_reason is "error"
    # one per token id when the request asked for logprobs: its text, logprob and alternatives
    logprobs: list[m.TokenLogprobs] | None = None


class _Pending:
    """What the daemon said about one request and its generation has not taken yet.

    One writer (the receive loop) and one reader (the generation), in one thread: a deque,
    and the reader's task parked while it waits (woken with trio's low-level reschedule:
    an `Event` per wait cost a fifth more per chunk). The daemon's credits bound it."""

    def __init__(self) -> None:
        self.items: deque = deque()
        self.finished = False  # the request's `Finished` came: nothing more will
        self.closed = False  # no more will come (the daemon went silent)
        self._reader: trio.lowlevel.Task | None = None  # parked in `wait`

    def put(self, msg: Any) -> None:
        self.items.append(msg)
        if type(msg) is m.Finished:
            self.finished = True
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            trio.lowlevel.reschedule(reader)

    async def wait(self) -> None:
        """Until something was put, or the pending was closed."""
        self._reader = trio.lowlevel.current_task()

        def abort(_: Any) -> trio.lowlevel.Abort:
            self._reader = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


def most_chunks(sampling: SamplingParams) -> int:
    """The most chunks a request with `sampling` can be sent: one per token at most, and one
    more with the text held back for its stop strings when it ends (held only if it has
    some). Credits past that are never used."""
    return sampling.max_tokens + (1 if sampling.stop else 0)


class AsyncGeneration:
    """One request's stream of chunks; iterate it, `cancel()` it, then read `result`."""

    def __init__(self, client: AsyncClient, request_id: str, credit_window: int,
                 pending: _Pending, most_chunks: int):
        self._client = client
        self.request_id = request_id
        self.prompt_tokens = 0
        self._grant_every = max(1, credit_window // 2)
        # the credits it may still need beyond its window: a request sends at most
        # `most_chunks` chunks (see `most_chunks`), so a grant past that would go unused
        self._grantable = max(0, most_chunks - credit_window)
        self._pending = pending
        self._text: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[m.TokenLogprobs] | None = None
        self._ungranted = 0
        self._error: str | None = None
        self._result: GenerationResult | None = None

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise SluiceError("the generation has not finished; iterate it to the end first")
        return self._result

    @property
    def done(self) -> bool:
        return self._result is not None

    def __aiter__(self) -> AsyncGeneration:
        return self

    async def __anext__(self) -> m.Chunk:
        while self._result is None:
            item = await self._client._next_item(self._pending)
            if type(item) is m.Chunk:
                self._text.append(item.text)
                self._ids.extend(item.token_ids)
                if item.logprobs is not None:
                    if self._logprobs is None:
                        self._logprobs = []
                    self._logprobs.extend(item.logprobs)
                self._ungranted += 1
                if self._ungranted >= self._grant_every and self._grantable:
                    await self._grant()
                return item
            if isinstance(item, m.Finished):
                self._finish(item)
            elif isinstance(item, m.Error):
                self._error = item.message
            elif isinstance(item, m.Accepted):
                self.prompt_tokens = item.prompt_tokens
        raise StopAsyncIteration

    async def cancel(self) -> None:
        """Ask the daemon to stop; iteration then ends with finish_reason "cancelled"."""
        if self._result is None:
            await self._client._send(m.Cancel(self.request_id))

    async def collect(self) -> GenerationResult:
        async for _ in self:
            pass
        return self.result

    async def _grant(self) -> None:
        """Give back the credits of the chunks taken since the last grant (half a window), as
        far as the request can still use them."""
        grant, self._ungranted = min(self._ungranted, self._grantable), 0
        if grant and not self._pending.finished:  # an ended request has no use for credits
            self._grantable -= grant
            await self._client._send(m.Credit(self.request_id, grant))

    def _finish(self, item: m.Finished) -> None:
        self._result = GenerationResult(
            self.request_id, item.reason.name.lower(), "".join(self._text), self._ids,
            item.usage, item.timings, self._error, self._logprobs,
        )
        self._client._forget(self.request_id)


class AsyncClient:
    """A connection to a daemon; use `async with`. Safe to share between trio tasks."""

    def __init__(self, address: str, *, credit_window: int = 16, heartbeat_interval: float = 1.0,
                 daemon_timeout: float = 15.0, tenant: str = "default",
                 curve_server_key: str | bytes | None = None,
                 curve_keypair: tuple[str | bytes, str | bytes] | None = None):
        if credit_window < 1:
            raise ValueError("credit_window must be >= 1")
        if (curve_server_key is None) != (curve_keypair is None):
            raise ValueError("CURVE needs both curve_server_key and curve_keypair")
        self._curve = None
        if curve_server_key is not None:
            self._curve = tuple(_z85_key(name, key) for name, key in (
                ("curve_server_key", curve_server_key), ("curve_keypair[0]", curve_keypair[0]),
                ("curve_keypair[1]", curve_keypair[1])))
        self.address = address
        self.credit_window = credit_window
        self.heartbeat_interval = heartbeat_interval
        self.daemon_timeout = daemon_timeout
        self.tenant = tenant
        self._codec = Codec(m.SERVER_MESSAGES)
        self._ids = itertools.count(1)
        self._pending: dict[str, _Pending] = {}
        self._info_waiters: list[Any] = []
        self._gone: DaemonGone | None = None
        self._frame_limit: int | None = None  # the daemon's max frame bytes; 0: it does not say
        self._max_credits = 0  # the credits the daemon lets a request hold; 0: it does not say

    async def __aenter__(self) -> AsyncClient:
        self._socket = Socket(zmq.DEALER)
        self._socket.zmq.setsockopt(zmq.ROUTING_ID, os.urandom(8))
        if self._curve is not None:
            server, public, secret = self._curve
            self._socket.zmq.curve_serverkey = server
            self._socket.zmq.curve_publickey = public
            self._socket.zmq.curve_secretkey = secret
        self._socket.connect(self.address)
        self._last_heard = trio.current_time()
        self._nursery_manager = trio.open_nursery()
        nursery = await self._nursery_manager.__aenter__()
        nursery.start_soon(self._receive_loop)
        nursery.start_soon(self._heartbeats)
        self._nursery = nursery
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        self._nursery.cancel_scope.cancel()
        try:
            return await self._nursery_manager.__aexit__(*exc)
        finally:
            self._socket.close()

    async def generate(
        self, prompt: str | None = None, *, messages: Sequence[dict] | None = None,
        prompt_ids: Sequence[int] | None = None, max_tokens: int = 16, temperature: float = 1.0,
        top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
        stop: Sequence[str] = (), ignore_eos: bool = False, priority: int = 0,
        tenant: str | None = None, stop_token_ids: Sequence[int] = (), logprobs: bool = False,
        top_logprobs: int = 0, timeout: float | None = None,
        json_schema: dict | str | None = None, regex: str | None = None,
        choices: Sequence[str] | None = None, grammar: str | None = None,
        logit_bias: Mapping[int, float] | None = None,
    ) -> AsyncGeneration:
        """Send a request and wait until the daemon accepts it; raise if it refuses.

        `logprobs` asks for each sampled token's logprob, `top_logprobs` (which implies it)
        for that many of the most likely tokens at each position as well. `timeout`: seconds
        after which the daemon ends the request with `timeout`, waiting or running.
        At most one of `json_schema` (an object or its text), `regex`, `choices` (the output
        is one of them) and `grammar` (Lark) constrains the output; `logit_bias` maps token
        ids to what is added to their logits, in [-100, 100]. A grammar the daemon's engine
        cannot build is refused (`InvalidRequestError` naming `sampling.grammar`)."""
        rid = str(next(self._ids))
        try:  # refused here as the daemon would refuse it, without a round trip
            kind, text = grammar_of(json_schema, regex, choices, grammar)
            bias = sorted((logit_bias or {}).items())
            sampling = SamplingParams(
                max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                top_k=top_k, min_p=float(min_p), seed=seed, stop=tuple(stop),
                stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos,
                logprobs=top_logprobs if logprobs or top_logprobs else None,
                logit_bias_ids=tuple(int(t) for t, _ in bias),
                logit_bias_values=tuple(float(b) for _, b in bias),
                grammar_kind=kind, grammar=text)
        except InvalidParams as exc:
            raise InvalidRequestError(exc.message, field=f"sampling.{exc.field}",
                                      request_id=rid) from None
        chat = None if messages is None else tuple(
            m.ChatMessage(str(x["role"]), str(x["content"])) for x in messages)
        if self._frame_limit is None:
            await self.status()  # once per connection: the answer carries the daemon's limits
        window = self.credit_window
        if 0 < self._max_credits < window:  # more would be clamped: never sent
            window = self._max_credits
        msg = m.Generate(rid, prompt=prompt, messages=chat,
                         prompt_ids=None if prompt_ids is None else tuple(prompt_ids),
                         sampling=sampling, priority=priority, tenant=tenant or self.tenant,
                         credits=window, timeout=timeout)
        frame = self._codec.encode(msg)
        self._check_frame_size(frame)
        pending = _Pending()
        self._pending[rid] = pending
        await self._send_frame(frame)
        generation = AsyncGeneration(self, rid, window, pending, most_chunks(sampling))
        first = await self._next_item(pending)
        if isinstance(first, m.Rejected):
            self._forget(rid)
            raise error_for(first)
        if isinstance(first, m.Accepted):
            generation.prompt_tokens = first.prompt_tokens
        else:  # an Error or Finished before acceptance: the iteration will show it
            pending.items.appendleft(first)
        return generation

    async def generate_choices(self, prompt: str | None = None, *, n: int,
                               seed: int | None = None, **kwargs: Any) -> list[AsyncGeneration]:
        """`n` requests for the same prompt, as OpenAI's `n`: each choice its own seed stream
        (choice 0 keeps `seed`). The first is sent and accepted before the others, which
        then find its prompt blocks in the prefix cache once it has computed them."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidRequestError(f"n must be an integer >= 1, got {n!r}", field="n")
        generations = []
        for index in range(n):
            choice = None if seed is None else choice_seed(seed, index)
            generations.append(await self.generate(prompt, seed=choice, **kwargs))
        return generations

    async def status(self) -> m.ServerInfo:
        """What any client may know: protocol version and model name."""
        send, recv = trio.open_memory_channel[m.ServerInfo](1)
        self._info_waiters.append(send)
        with trio.move_on_after(self.daemon_timeout):
            await self._send(m.Describe())
            return await recv.receive()
        if send in self._info_waiters:
            self._info_waiters.remove(send)
        raise self._unanswered()

    # -- internals ----------------------------------------------------------------------------

    def _check_frame_size(self, frame: bytes) -> None:
        limit = self._frame_limit
        if limit and len(frame) > limit:
            raise InvalidRequestError(
                f"the request encodes to {len(frame)} bytes; the daemon reads frames of at "
                f"most {limit} bytes", field="frame")

    async def _send(self, msg: Any) -> None:
        await self._send_frame(self._codec.encode(msg))

    async def _send_frame(self, frame: bytes) -> None:
        if self._gone is not None:
            raise self._gone
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._socket.send_nowait(frame):  # the common case: there is room
            return
        # a DEALER waits for a connection to queue into: with a daemon that is not there, or
        # CURVE handshakes that keep failing, that wait would never end
        with trio.move_on_after(self.daemon_timeout):
            await self._socket.send(frame)
            return
        raise self._unanswered()

    def _unanswered(self) -> DaemonGone:
        keys = ", and are the CURVE keys the daemon's" if self._curve is not None else ""
        return DaemonGone(f"no answer from the daemon at {self.address} within "
                          f"{self.daemon_timeout:g}s: is it running there{keys}?")

    async def _next_item(self, pending: _Pending) -> Any:
        items = pending.items
        if items:
            # what one frame brought is taken without a turn of the loop each; a cancelled
            # reader still stops here
            await trio.lowlevel.checkpoint_if_cancelled()
            return items.popleft()
        while not items:
            if pending.closed or self._gone is not None:
                raise self._gone or DaemonGone("connection closed")
            await pending.wait()
        return items.popleft()

    def _forget(self, rid: str) -> None:
        self._pending.pop(rid, None)

    async def _receive_loop(self) -> None:
        socket = self._socket
        while True:
            frames = await socket.recv_multipart()
            self._last_heard = trio.current_time()
            self._route_frames(frames)
            # what queued up behind it is routed in the same turn (a bounded number): the
            # readers then find it waiting instead of a frame per turn of the loop
            for _ in range(_FRAMES_PER_TURN - 1):
                queued = socket.recv_multipart_nowait()
                if queued is None:
                    break
                self._route_frames(queued)

    def _route_frames(self, frames: list[bytes]) -> None:
        for frame in frames:
            try:
                batch = self._codec.decode_batch(frame)  # the daemon batches messages
            except CodecError:
                continue  # not for this protocol version; nothing to route it to
            for msg in batch:
                self._route(msg)

    def _route(self, msg: Any) -> None:
        if type(msg) is m.Chunk:  # nearly every message
            pending = self._pending.get(msg.request_id)
            if pending is not None:
                pending.put(msg)
            return
        if isinstance(msg, m.ServerInfo):
            self._frame_limit = msg.max_frame_bytes
            self._max_credits = msg.max_credits
            while self._info_waiters:
                self._info_waiters.pop(0).send_nowait(msg)
            return
        if (isinstance(msg, m.Rejected) and not msg.request_id and msg.field == "connection"
                and msg.code is m.RejectCode.OVERLOADED):
            # the daemon had forgotten this connection (it did not read) and ended its
            # requests; it serves it again from here on
            for rid, pending in list(self._pending.items()):
                pending.put(m.Error(rid, msg.message))
                pending.put(m.Finished(rid, m.FinishReason.ERROR))
            return
        pending = self._pending.get(getattr(msg, "request_id", ""))
        if pending is not None:
            pending.put(msg)

    async def _heartbeats(self) -> None:
        while True:
            with trio.move_on_after(self.heartbeat_interval):  # no connection: no heartbeat
                try:
                    await self._socket.send(self._codec.encode(m.Heartbeat()))
                except zmq.ZMQError:
                    pass
            await trio.sleep(self.heartbeat_interval)
            silent = trio.current_time() - self._last_heard
            if self._pending and silent > self.daemon_timeout:
                self._gone = DaemonGone(f"no word from the daemon for {silent:.1f}s")
                for pending in list(self._pending.values()):
                    pending.close()


class Generation:
    """The blocking twin of `AsyncGeneration`."""

    def __init__(self, client: Client, inner: AsyncGeneration):
        self._client = client
        self._inner = inner
        self.request_id = inner.request_id

    def __iter__(self) -> Iterator[m.Chunk]:
        while True:
            try:
                yield self._client._call(self._inner.__anext__)
            except StopAsyncIteration:
                return

    def cancel(self) -> None:
        self._client._call(self._inner.cancel)

    def collect(self) -> GenerationResult:
        return self._client._call(self._inner.collect)

    @property
    def result(self) -> GenerationResult:
        return self._inner.result

    @property
    def prompt_tokens(self) -> int:
        return self._inner.prompt_tokens


class Client:
    """Blocking client: an `AsyncClient` on a trio loop in a background thread."""

    def __init__(self, address: str, **options: Any):
        self._async = AsyncClient(address, **options)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True,
                                        name="sluice-client")
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    async def _main(self) -> None:
        self._startup_error: BaseException | None = None
        try:
            async with self._async:
                self._token = trio.lowlevel.current_trio_token()
                self._stop = trio.Event()
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:  # surfaced to the constructor
            self._startup_error = exc
            self._ready.set()

    def _call(self, fn: Any, *args: Any) -> Any:
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def generate(self, prompt: str | None = None, **kwargs: Any) -> Generation:
        return Generation(self, self._call(lambda: self._async.generate(prompt, **kwargs)))

    def status(self) -> m.ServerInfo:
        return self._call(self._async.status)

    def close(self) -> None:
        if self._thread.is_alive():
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            self._thread.join(timeout=5)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _z85_key(name: str, key: str | bytes) -> bytes:
    """A CURVE key as ZeroMQ takes it: 40 characters of Z85."""
    raw = key.encode() if isinstance(key, str) else key
    if len(raw) != 40:
        raise ValueError(f"{name}: a CURVE key is 40 characters of Z85, got {len(raw)}")
    return raw
