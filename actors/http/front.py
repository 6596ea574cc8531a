"""The HTTP actor: an OpenAI-compatible front door beside the ZeroMQ gateway.

A small ASGI app, served in this actor's nursery by hypercorn's protocols on the connections
and accept loop of `actors.http.server` (a cap on connections, a deadline on each write,
HTTP/1.1 unless HTTP/2 is configured); the HTTP parsing and keep-alive are hypercorn's. Each
HTTP request is its own stream of the one Stream actor the front keeps for all of them (the
actor ZeroMQ connections get, supervised as transient, its connection id random and known to no
client): a connection's requests each have their own credits, watermarks, pause timeout and one
terminal message there, so each HTTP request is metered exactly as a ZeroMQ client's request
is. What the stream says to its client is handed, by request id, to that request's response in
process instead of over a socket (`ResponseRouter`, `Replies`). The response gives chunks'
credits back once their bytes were handed to hypercorn (whose `send` waits while the socket is
full), so a client that stops reading is paused and then timed out like a slow ZeroMQ client,
and one that disconnects sends the stream its request's `Cancel`, which ends it and frees its
KV.

One stream for all, not one per request: a step's tokens reach the front in one message
instead of one per request, and a request costs no actor, inbox or socket of its own. If that
stream fails, the requests it holds end with an error (a ZeroMQ connection's would too) and
the next request opens a new one. A request that reached the failed stream before the front
heard of the failure is refused there unseen, and sent once more, to the new stream.

A request body is turned into the same `m.Generate` the gateway decodes
(`actors.http.openai_api`), so validation, limits and rejections are the daemon's own; this
actor adds only what HTTP has: API keys (`Authorization: Bearer`, compared in constant time,
mapped to tenants, never logged), concurrent requests and bodies being read (each tenant at
most its share of either), header, body bytes and body read time (the `[http]` table), and
the mapping of outcomes to statuses. `GET /health` asks the Scheduler.

Asked (`Ask`), it says the address it bound or lists its live streams (for drain and
reconcile) and how many requests it is answering; `Drain`/`EndDrain` make new requests 503
or admit them again. A response write that waits `send_timeout` for its client ends the
request as if the client had gone.

What does not belong here: the response of one generation (`actors.http.exchange`), the
OpenAI shapes (`actors.http.openai_api`).
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import structlog
import trio
import zmq

from sluice.actors.front.intake import GrammarBusy, GrammarChecks, check_generate
from sluice.actors.front.limits import Limits
from sluice.actors.runtime import messages as am
from sluice.actors.http import openai_api as api
from sluice.actors.runtime.base import RESOURCE_ERRNOS, Actor, Handler, Inbox, Outbox, Outboxes
from sluice.actors.runtime.questions import Questions
from sluice.actors.http.exchange import (
    ClientGone, Exchange, Replies, deadline_send, header, send_error, send_json, send_text,
    server_log, watch_disconnect,
)  # fmt: skip
from sluice.actors.http.server import Connections, ServerConfig, connection_cap, serve
from sluice.actors.runtime.reports import Endpoint, EndpointQuery
from sluice.actors.front.stream import Stream
from sluice.actors.runtime.supervisor import Supervisor
from sluice.ipc import messages as m

log = structlog.get_logger("sluice.http")

PARSE_ON_LOOP_BYTES = 64 * 1024  # request bodies up to this size are parsed on the loop


def model_alias(model_name: str) -> str | None:
    """The short name a request may give for the model: its folder's name or its file's stem
    ("embedded:SmolLM2-135M.Q8_0.gguf" -> "SmolLM2-135M.Q8_0"); None when it is the name."""
    name = model_name.removeprefix("embedded:").rstrip("/").rsplit("/", 1)[-1]
    for suffix in (".gguf", ".safetensors", ".bin"):
        name = name.removesuffix(suffix)
    return name if name and name != model_name else None


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The error a request's client gets from a group of its choices' errors: an HTTP one
    first, then a gone client, else the group as it is."""
    for kind in (api.ApiError, ClientGone):
        matched, _ = group.split(kind)
        if matched is not None:
            while isinstance(matched, BaseExceptionGroup):
                matched = matched.exceptions[0]
            return matched
    return group


@dataclass(frozen=True)
class HttpSettings:
    """The `[http]` table: where the front listens, its limits and its API keys."""

    listen: str | None = None  # "HOST:PORT"; None: no HTTP front
    model_name: str | None = None  # what /v1/models lists and requests name; None: derived
    max_concurrent_requests: int = 256  # generations being answered; over it: 429
    max_body_reads: int = 64  # request bodies being read (not yet generations); over it: 429
    # the most of either one tenant may hold, as a fraction (at least one request), once the
    # API keys name more than one tenant
    tenant_share: float = 0.5
    # live connections; None: half of what the fd limit leaves past `[limits] reserved_fds`.
    # At the cap idle connections are closed to make room, else new ones wait to be accepted
    max_connections: int | None = None
    max_header_bytes: int = 16 * 1024  # request line and headers: over it, 414 or 431
    max_body_bytes: int = 4 * 1024 * 1024  # over it: 413, refused before it is read in full
    read_timeout: float = 30.0  # seconds to receive a request's body: over it, 408
    keep_alive_timeout: float = 5.0  # an idle connection (or one slow to send headers) closes
    # seconds a response write may wait for its client (a shut TCP or HTTP/2 window): past it
    # the request ends as if the client had gone, and an HTTP/1.1 connection is closed. Keep
    # it above `[stream] pause_timeout`, which ends a request whose client stopped reading
    send_timeout: float = 60.0
    http2: bool = False  # also HTTP/2 in cleartext (h2c); off: HTTP/1.1 only
    retry_after: int = 1  # seconds, in `Retry-After` of 429 and 503
    initial_credits: int = 16  # chunks a request may have in flight before it writes one
    tenants: dict[str, Any] = field(default_factory=dict)  # tenant -> [API keys]
    # a file of `TENANT KEY` lines; relative: a systemd credential ($CREDENTIALS_DIRECTORY)
    tenant_keys_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_concurrent_requests", "max_body_reads", "max_connections",
                     "max_header_bytes", "max_body_bytes", "retry_after", "initial_credits"):
            value = getattr(self, name)
            if value is None and name == "max_connections":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"http.{name}: must be a positive integer, got {value!r}")
        share = self.tenant_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise ValueError(f"http.tenant_share: must be a fraction in (0, 1], got {share!r}")
        if not isinstance(self.http2, bool):
            raise ValueError(f"http.http2: must be true or false, got {self.http2!r}")
        for name in ("read_timeout", "keep_alive_timeout", "send_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"http.{name}: must be a positive number, got {value!r}")
        for tenant, keys in self.tenants.items():
            if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
                raise ValueError(f"http.tenants.{tenant}: must be a list of API keys")


class ResponseRouter:
    """The HTTP stream's sink: what it says about each request, handed to that request's
    response (its `Replies`) as the typed messages.

    The stream's edge toward its clients, like the socket a ZeroMQ connection's frames go
    to, so no actor inbox. What waits for one response is bounded by its request's credits
    (only chunks need them, and one request has one terminal message). Messages for a
    request whose response is over are dropped, as a closed socket's would be."""

    def __init__(self) -> None:
        self.routes: dict[str, Replies] = {}

    def send(self, connection: bytes, messages: list) -> None:
        routes = self.routes
        for msg in messages:
            # heartbeats are for ZeroMQ peers; an HTTP client's liveness is its TCP connection
            if type(msg) is not m.Heartbeat and (replies := routes.get(msg.request_id)):
                replies.put(msg)


class KeyRing:
    """API keys to tenants. Every lookup compares against every key, in constant time."""

    def __init__(self, tenants: dict[str, list[str]]):
        self._keys = [(key.encode(), tenant) for tenant, keys in tenants.items() for key in keys]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def tenants(self) -> int:
        return len({tenant for _, tenant in self._keys})

    def tenant(self, key: bytes) -> str | None:
        found = None
        for known, tenant in self._keys:
            if hmac.compare_digest(known, key):
                found = tenant
        return found


class Slots:
    """Requests of one kind the front holds (generations, or bodies being read): at most
    `size`, and at most `share` of them one tenant's. Over either: 429, naming the setting."""

    def __init__(self, setting: str, size: int, share: float, retry_after: int):
        self.setting = setting  # the `[http]` key of `size`
        self.size = size
        self.share = share
        self.per_tenant = max(1, int(size * share))
        self.retry_after = retry_after
        self.held = 0
        self.by_tenant: dict[str, int] = {}

    def check(self, tenant: str) -> None:
        """Refuse the request if `tenant` could not take one now."""
        if self.held >= self.size:
            raise self._refusal(f"too many concurrent HTTP requests (http.{self.setting} = "
                                f"{self.size})")
        if self.by_tenant.get(tenant, 0) >= self.per_tenant:
            raise self._refusal(
                f"tenant {tenant!r} holds its share of http.{self.setting} = {self.size}: "
                f"{self.per_tenant} (http.tenant_share = {self.share})")

    @contextmanager
    def hold(self, tenant: str) -> Iterator[None]:
        self.check(tenant)
        self.held += 1
        self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + 1
        try:
            yield
        finally:
            self.held -= 1
            left = self.by_tenant[tenant] - 1
            if left:
                self.by_tenant[tenant] = left
            else:
                del self.by_tenant[tenant]

    def _refusal(self, message: str) -> api.ApiError:
        return api.ApiError(429, message, type="rate_limit_error", code="overloaded",
                            retry_after=self.retry_after)


class HttpFront(Actor):
    name = "http"

    def __init__(self, settings: HttpSettings, *, supervisor: Supervisor,
                 make_stream: Callable[[bytes, ResponseRouter], Stream], scheduler: Outbox,
                 model_name: str, max_model_len: int, heartbeat_interval: float = 1.0,
                 reserved_fds: int = 256, limits: Limits | None = None,
                 inbox: Inbox | None = None, grammars: GrammarChecks | None = None):
        super().__init__(inbox=inbox)
        self.settings = settings
        self.limits = limits or Limits()
        self.supervisor = supervisor
        self.make_stream = make_stream
        self.scheduler = scheduler
        self.model_name = settings.model_name or model_name
        self.model_alias = model_alias(self.model_name)  # the short name beside it
        # grammars checked already (good ones and bad ones), and the threads checking them:
        # the daemon's, shared with its ZeroMQ connections
        self.grammars = grammars or GrammarChecks(self.limits)
        self.max_model_len = max_model_len
        self.heartbeat_interval = heartbeat_interval
        self.keys = KeyRing(settings.tenants)
        self.address: str | None = None  # HOST:PORT bound, kept across restarts
        self.draining = False
        self.drain_refusals = 0  # requests refused while the daemon drained (for status)
        # kept across restarts: a stream that outlives a crash still reports its close here
        self.streams: dict[bytes, Stream] = {}
        self.stream: Stream | None = None  # the one new requests go to; None: open one
        self.router = ResponseRouter()
        self._opening = trio.Lock()
        # once the keys name more than one tenant, none may hold more than its share
        share = settings.tenant_share if self.keys.tenants() > 1 else 1.0
        self.generations = Slots("max_concurrent_requests", settings.max_concurrent_requests,
                                 share, settings.retry_after)
        self.body_reads = Slots("max_body_reads", settings.max_body_reads, share,
                                settings.retry_after)
        # the live connections; each removes itself as it ends, a server's end ends them all
        self.connections = Connections(settings.max_connections
                                       or connection_cap(reserved_fds))
        self.questions = Questions("http-replies")  # the scheduler's answers, for /health
        self.askers = Outboxes()

    def handlers(self) -> dict[type, Handler]:
        return {
            am.StreamClosed: self.on_stream_closed,
            am.Drain: self.on_drain,
            am.EndDrain: self.on_end_drain,
            am.Ask: self.on_ask,
        }

    def close(self) -> None:
        super().close()
        self.questions.close()
        self.askers.close()
        for stream in self.streams.values():
            stream.close()

    async def background(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self.questions.take_replies)
        nursery.start_soon(self._heartbeats)
        binds = await nursery.start(self._serve)
        self.address = binds[0].removeprefix("http://")
        log.info("http listening", address=self.address)

    async def _serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        config = ServerConfig()
        config.send_timeout = self.settings.send_timeout
        config.http2 = self.settings.http2
        config.bind = [self.address or self.settings.listen]
        config.h11_max_incomplete_size = self.settings.max_header_bytes
        config.h2_max_header_list_size = self.settings.max_header_bytes
        config.keep_alive_timeout = self.settings.keep_alive_timeout
        config.include_server_header = False
        config.backlog = 1024  # a burst of connections waits to be accepted, its SYNs not dropped
        config.accesslog = None  # a request's line is not for the journal
        config.errorlog = server_log("sluice.http.server")
        await serve(self.asgi, config, self.connections, task_status=task_status)

    # -- from actors ------------------------------------------------------------------------

    async def on_stream_closed(self, msg: am.StreamClosed) -> None:
        stream = self.streams.pop(msg.connection, None)
        if stream is not None:
            stream.inbox.put(am.StreamClosed(msg.connection))  # nothing more is routed to it
        if stream is self.stream:
            self.stream = None  # the next request opens another

    async def on_drain(self, msg: am.Drain) -> None:
        self.draining = True

    async def on_end_drain(self, msg: am.EndDrain) -> None:
        self.draining = False

    async def on_ask(self, msg: am.Ask) -> None:
        if isinstance(msg.query, EndpointQuery):
            self.askers.put(msg.reply_to, am.Reply(msg.token, Endpoint(self.address or "")))
        elif isinstance(msg.query, am.ListConnections):
            live = am.Connections(frozenset(self.streams),
                                 tuple(stream.inbox.address for stream in self.streams.values()),
                                 m.GatewayStats(drain_refusals=self.drain_refusals),
                                 answering=self.generations.held + self.body_reads.held)
            self.askers.put(msg.reply_to, am.Reply(msg.token, live))

    async def on_crash(self, exc: BaseException) -> None:
        for stream in self.streams.values():
            stream.inbox.put(am.FailAll(f"http front failed: {type(exc).__name__}"))

    # -- the ASGI app -----------------------------------------------------------------------

    async def asgi(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        send = deadline_send(send, self.settings.send_timeout)
        try:
            try:
                await self._route(scope, receive, send)
            except api.ApiError as error:
                await send_error(send, error)
        except ClientGone:
            pass

    async def _route(self, scope: dict, receive: Callable, send: Callable) -> None:
        self._check_head(scope)
        method, path = scope["method"], scope["path"]
        routes = {"/health": "GET", "/v1/models": "GET", "/v1/chat/completions": "POST",
                  "/v1/completions": "POST"}
        if path not in routes:
            raise api.ApiError(404, f"no route {path}", type="not_found_error")
        if method != routes[path]:
            raise api.ApiError(405, f"{path} takes {routes[path]}")
        if path == "/health":
            await self._health(send)
            return
        tenant = self._tenant(scope)
        if path == "/v1/models":
            names = [self.model_name] + ([self.model_alias] if self.model_alias else [])
            await send_json(send, 200, {"object": "list", "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "sluice",
                 "max_model_len": self.max_model_len} for name in names]})
            return
        if self.draining:
            self.drain_refusals += 1
            raise api.ApiError(503, "the daemon is draining", type="server_error",
                               code="draining", retry_after=self.settings.retry_after)
        # a body being read is no generation, but one that could not start is not read
        self.generations.check(tenant)
        with self.body_reads.hold(tenant):  # until parsed: a body held counts, read or not
            raw = await self._read_body(scope, receive)
            # a large body is parsed on a worker thread: megabytes of JSON would hold the
            # loop, and every other client's stream with it, for tens of milliseconds
            body = (api.parse_body(raw) if len(raw) <= PARSE_ON_LOOP_BYTES
                    else await trio.to_thread.run_sync(_parse_off_loop, raw))
            if isinstance(body, api.ApiError):
                try:
                    raise body
                finally:  # this frame, in the error's traceback, must not hold the error
                    body = None
        with self.generations.hold(tenant):
            await self._generate(path == "/v1/chat/completions", body, tenant, receive, send,
                                 self._party(scope, tenant))

    def _check_head(self, scope: dict) -> None:
        """Refuse a request line and headers over `max_header_bytes`. hypercorn stops buffering
        them past it, but what arrived whole in one read is parsed whatever its size."""
        limit = self.settings.max_header_bytes
        line = (len(scope["method"]) + len(scope["raw_path"]) + len(scope["query_string"])
                + len(" ? HTTP/1.1\r\n"))  # the spaces, "?", version and line end
        if line > limit:
            raise api.ApiError(414, f"the request line exceeds http.max_header_bytes = {limit}",
                               code="uri_too_long")
        if line + sum(len(name) + len(value) + 4 for name, value in scope["headers"]) > limit:
            raise api.ApiError(431, f"the request's headers exceed http.max_header_bytes = "
                               f"{limit}", code="headers_too_large")

    def _tenant(self, scope: dict) -> str:
        """The tenant of the request's API key; `default` when no keys are configured."""
        if not self.keys:
            return "default"
        scheme, _, key = header(scope, b"authorization").partition(b" ")
        tenant = self.keys.tenant(key.strip()) if scheme.lower() == b"bearer" else None
        if tenant is None:
            raise api.ApiError(401, "a valid API key is required (Authorization: Bearer KEY)",
                               type="authentication_error", code="invalid_api_key")
        return tenant

    def _party(self, scope: dict, tenant: str) -> str:
        """Who the request's grammar checks wait in turn as (`GrammarChecks`): its tenant,
        when keys tell tenants apart; else its client's address (behind a proxy, every
        client is the proxy's)."""
        if self.keys:
            return f"tenant {tenant!r}"
        client = scope.get("client")
        return f"client {client[0]}" if client else "client (unknown address)"

    async def _read_body(self, scope: dict, receive: Callable) -> bytes:
        limit = self.settings.max_body_bytes
        length = header(scope, b"content-length")
        if length.isdigit() and int(length) > limit:
            raise _too_large(limit)  # before a byte of it is read
        parts, size = [], 0
        with trio.move_on_after(self.settings.read_timeout) as timer:
            while True:
                event = await receive()
                if event["type"] == "http.disconnect":
                    raise ClientGone
                size += len(event.get("body", b""))
                if size > limit:
                    raise _too_large(limit)  # a chunked body: nothing more of it is read
                parts.append(event.get("body", b""))
                if not event.get("more_body", False):
                    break
        if timer.cancelled_caught:
            raise api.ApiError(408, "the request body did not arrive within "
                               f"http.read_timeout = {self.settings.read_timeout} s",
                               code="request_timeout")
        return b"".join(parts)

    async def _health(self, send: Callable) -> None:
        try:
            snapshot = await self.questions.ask(self.scheduler, lambda address, token: am.Ask(
                m.StatusQuery(), address, token), 5.0)
        except trio.TooSlowError:
            await send_text(send, 503, "the scheduler does not answer")
            return
        report = snapshot.report
        if report.state != "serving":
            await send_text(send, 503, report.state)
        elif report.worker.state != "ready":
            failure = f": {report.worker.failure}" if report.worker.failure else ""
            await send_text(send, 503, f"worker {report.worker.state}{failure}")
        else:
            await send_text(send, 200, "serving")

    # -- one generation -----------------------------------------------------------------------

    async def _generate(self, chat: bool, body: dict, tenant: str, receive: Callable,
                        send: Callable, party: str) -> None:
        request_id = os.urandom(12).hex()  # unguessable, and the response's id
        parse = api.chat_request if chat else api.completion_request
        request = parse(body, request_id=request_id, tenant=tenant,
                        credits=self.settings.initial_credits, max_model_len=self.max_model_len,
                        limits=self.limits)
        if request.model not in (self.model_name, self.model_alias or self.model_name):
            also = f" (or {self.model_alias!r})" if self.model_alias else ""
            raise api.ApiError(404, f"the model {request.model!r} does not exist; this server "
                               f"serves {self.model_name!r}{also}", type="not_found_error",
                               param="model", code="model_not_found")
        if request.generate.sampling.constrained:
            await self._check_grammar(request.generate, api.grammar_param(body), party)
        if request.n > 1:
            await self._generate_choices(request, request_id, receive, send)
            return
        for last_try in (False, True):
            stream = await self._open_stream()
            if await self._answer(request, request_id, stream, receive, send, last_try):
                return
            # the stream had closed (it crashed) before the front heard: the request was
            # refused unseen, so it goes to a stream opened in its place
            if stream is self.stream:
                self.stream = None

    async def _generate_choices(self, request: api.ApiRequest, request_id: str,
                                receive: Callable, send: Callable) -> None:
        """n > 1: one request per choice, each with its own seed stream, answered as one
        completion. The first choice runs alone until its first token, so its prompt's
        blocks are in the prefix cache when the others come and they hold them with it."""
        bodies: list[dict | None] = [None] * request.n
        first_token = trio.Event()

        async def choice(index: int) -> None:
            sampling = request.generate.sampling
            if sampling.seed is not None:
                sampling = dataclasses.replace(sampling,
                                               seed=api.choice_seed(sampling.seed, index))
            sub_id = f"{request_id}-{index}"
            sub = dataclasses.replace(request, n=1, generate=dataclasses.replace(
                request.generate, request_id=sub_id, sampling=sampling))
            sent: list[dict] = []

            async def capture(message: dict) -> None:
                sent.append(message)

            for last_try in (False, True):
                stream = await self._open_stream()
                if await self._answer(sub, sub_id, stream, trio.sleep_forever, capture,
                                      last_try, first_token if index == 0 else None):
                    break
                if stream is self.stream:
                    self.stream = None
            first_token.set()  # a first choice that ended without a token
            bodies[index] = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_disconnect, receive, nursery.cancel_scope)
                async with trio.open_nursery() as choices:
                    choices.start_soon(choice, 0)
                    await first_token.wait()
                    for index in range(1, request.n):
                        choices.start_soon(choice, index)
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # a choice's error is the request's
            raise _first_error(group) from None
        if any(body is None for body in bodies):
            raise ClientGone
        await send_json(send, 200, api.merge_choices(bodies, request_id))

    async def _check_grammar(self, generate: m.Generate, param: str, party: str) -> None:
        """A 400 naming `param` for a grammar the engine cannot take, or one whose check runs
        past `limits.max_grammar_compile_ms`; a 429 when its sender has too many checks
        waiting (see `GrammarChecks`: in a child process, each party's one at a time, each
        grammar once)."""
        sampling = generate.sampling
        try:
            problem = await self.grammars.problem(sampling.grammar_kind, sampling.grammar,
                                                  party)
        except GrammarBusy as busy:
            raise api.ApiError(429, str(busy), type="rate_limit_error", code="overloaded",
                               retry_after=self.settings.retry_after) from None
        if problem:
            raise api.invalid(param, problem)

    async def _answer(self, request: api.ApiRequest, request_id: str, stream: Stream,
                      receive: Callable, send: Callable, last_try: bool,
                      first_token: trio.Event | None = None) -> bool:
        """Answer `request` through `stream`; False when the stream was found closed, the
        request refused before anything was done for it, and `last_try` is false."""
        replies = Replies()
        exchange = Exchange(request, request_id, stream.inbox, replies, send,
                            self.settings.retry_after)
        exchange.first_token = first_token
        self.router.routes[request_id] = replies  # removed below, however the exchange ends
        try:
            # the Stream's own intake checks, here first: its inbox carries only what fits
            if (refused := check_generate(request.generate, self.limits)) is not None:
                raise api.rejected_error(refused, self.settings.retry_after)
            try:
                stream.inbox.put(request.generate)
            except TypeError as exc:
                # a value the checks above let through that no socket between actors carries:
                # this request fails, not the front
                log.error("request failed in the HTTP front", error=repr(exc))
                raise api.ended_error(
                    m.FinishReason.ERROR, "the request failed in the HTTP front: its values "
                    "cannot be carried between the daemon's actors") from None
            ended: api.ApiError | ClientGone | None = None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_disconnect, receive, nursery.cancel_scope)
                try:
                    await exchange.run()
                except (api.ApiError, ClientGone) as error:  # raised below, outside the nursery
                    ended = error
                nursery.cancel_scope.cancel()
            if ended is not None:
                if exchange.found_closed and not last_try:
                    return False
                raise ended
            return True
        finally:
            del self.router.routes[request_id]
            if not exchange.ended:  # its client is gone: the request is cancelled, KV freed
                stream.inbox.put(m.Cancel(request_id))

    async def _open_stream(self) -> Stream:
        """The stream new requests go to, opened if there is none."""
        async with self._opening:
            if self.stream is not None:
                return self.stream
            connection = os.urandom(12)
            try:
                stream = self.make_stream(connection, self.router)
            except zmq.ZMQError as exc:
                if exc.errno not in RESOURCE_ERRNOS:
                    raise
                # out of descriptors: this request is refused, not the daemon
                raise api.ApiError(429, "the daemon has no file descriptor left for another "
                                   "request", type="rate_limit_error", code="overloaded",
                                   retry_after=self.settings.retry_after) from None
            try:
                await self.supervisor.start_child(stream, transient=True)
            except BaseException:
                stream.close()
                raise
            self.streams[connection] = stream
            self.stream = stream
            return stream

    async def _heartbeats(self) -> None:
        """Keep the streams' silence timeout from firing while the front is up."""
        while True:
            for stream in self.streams.values():
                stream.inbox.put(m.Heartbeat())
            await trio.sleep(self.heartbeat_interval)


# An exception that a frame in its own traceback holds (a local it was kept in) forms a
# reference cycle with that frame, freed only by a full pass of the garbage collector (once a
# minute, see daemon/heap.py): under a stream of refused requests that held every connection
# of theirs, buffers and socket included, for up to a minute. Errors here are made where they
# are raised, and none crosses trio's thread boundary raised (its outcome holds it so).

def _too_large(limit: int) -> api.ApiError:
    return api.ApiError(413, f"the request body exceeds http.max_body_bytes = {limit}",
                        code="request_too_large")


def _parse_off_loop(raw: bytes) -> dict | api.ApiError:
    """`parse_body` on a worker thread: its error returned, not raised, and without the
    error it replaced (whose traceback's frames lead back to this thread's, which hold this
    one as their result)."""
    try:
        return api.parse_body(raw)
    except api.ApiError as error:
        error.__context__ = None
        return error.with_traceback(None)
