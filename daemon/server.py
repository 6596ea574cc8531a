"""Wiring the supervision tree: which actors exist, who talks to whom, in what order they start.

The Executor starts first, because the pool it reports (blocks, block size, context) sizes
the scheduler core; then the Scheduler, Tokenizer, Gateway and Control. Streams are started
by the Gateway, one per connection, as transient children (a crash never escalates).
`Daemon.run` returns when the daemon was drained and stopped; an `Escalation` from the
supervisor propagates (the process exits non-zero), and so does `WorkerStartFailed` when the
first worker never passes its health check.

The daemon learns the actors' state only by asking (`Questions`), and tells them what to do
only by message: the boot asks the executor for its worker's facts (the pool sizes the
scheduler core; none means the first worker never came up) and the gateway and control for
the addresses they bound; `STATUS=`, `/health` and the metrics come from the scheduler's
snapshots (and the Usage actor's totals, for the usage metrics); drain's idle check asks the scheduler, the tokenizer and each stream. What it
does to actors directly is supervision: starting and stopping them (`recover`, the
`worker_down` fault).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import structlog
import trio

from sluice.actors.runtime import messages as am
from sluice.actors.runtime.base import Actor, Inbox, Outbox
from sluice.actors.control import Control, ControlHooks
from sluice.actors.runtime.questions import Questions
from sluice.actors.executor.actor import Executor
from sluice.actors.executor.model_files import resolve_model_path
from sluice.actors.executor.null import NullExecutor
from sluice.actors.executor.protocol import InjectOutOfMemory
from sluice.actors.front.gateway import Gateway
from sluice.actors.front.intake import GrammarChecks
from sluice.actors.http.front import HttpFront
from sluice.actors.front.limits import raise_fd_limit
from sluice.actors.runtime.reports import (
    EndpointQuery, MetricsQuery, UsageQuery, WorkerFacts, WorkerQuery,
)  # fmt: skip
from sluice.actors.scheduler import Scheduler, SchedulerConfig
from sluice.actors.scheduler.actor import SchedulerActor
from sluice.actors.front.stream import Stream
from sluice.actors.runtime.supervisor import Supervisor
from sluice.actors.text import load_tokenizer
from sluice.actors.text.actor import Tokenizer
from sluice.actors.usage.actor import UsageLog
from sluice.daemon import version
from sluice.daemon.config import DaemonConfig, runtime_dir
from sluice.ipc import messages as m
from sluice.ipc.codec import Codec

log = structlog.get_logger("sluice.daemon")


class WorkerStartFailed(Exception):
    """The first worker never passed its health check: the daemon cannot serve at all."""


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: Path):
    """Tokenizers are immutable and slow to build from GGUF metadata: one per model path,
    with its byte table built here, off the event loop, before the first request needs it."""
    tokenizer = load_tokenizer(path)
    tokenizer.byte_vocabulary()
    return tokenizer


class Daemon:
    def __init__(self, config: DaemonConfig):
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.supervisor = Supervisor()
        self.stopped = trio.Event()
        self.executor: Actor | None = None
        self.scheduler: SchedulerActor | None = None
        self.tokenizer: Tokenizer | None = None
        self.gateway: Gateway | None = None
        self.control: Control | None = None
        self.http: HttpFront | None = None
        self.usage: UsageLog | None = None
        self.http_address: str | None = None  # HOST:PORT of the HTTP front, when enabled
        self.metrics_port: int | None = None  # bound port of /metrics, when enabled
        self.listen_address: str | None = None  # what the gateway bound, once it serves
        self.control_address: str | None = None  # what the control actor bound
        self.questions = Questions("daemon-replies")  # answers of the actors the daemon asks
        self._scheduler_inbox: Inbox | None = None
        self._inboxes: dict[str, Inbox] = {}  # the other actors', by actor name
        self._stream_outboxes: dict[str, Outbox] = {}  # drain asks each stream
        # tenants the config file names, so a reload can reset those it no longer names
        self._file_tenants: set[str] = set()
        self._grammars: GrammarChecks | None = None

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        old, new = raise_fd_limit()  # before anything sizes itself by it (the connection cap)
        log.info("file descriptor limit", soft_was=old, soft=new)
        tokenizer = await trio.to_thread.run_sync(_load_tokenizer, self.model_path)
        scheduler_inbox = self._scheduler_inbox = Inbox("scheduler")
        try:
            await self._run(tokenizer, scheduler_inbox, task_status)
        finally:
            scheduler_inbox.close()
            self.questions.close()
            for outbox in self._stream_outboxes.values():
                outbox.close()
            for actor in (self.executor, self.scheduler, self.tokenizer, self.gateway,
                          self.control, self.http, self.usage):
                if actor is not None:
                    actor.close()
            if self._grammars is not None:
                self._grammars.close()  # its checking processes

    async def _run(self, tokenizer, scheduler_inbox: Inbox, task_status: Any) -> None:
        cfg = self.config
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.supervisor.run, [])
            nursery.start_soon(self.questions.take_replies)
            self.executor = self._make_executor(tokenizer, scheduler_inbox)
            executor_inbox = self._inboxes["executor"] = self.executor.inbox
            await self.supervisor.start_child(self.executor)
            worker = await self.questions.ask(executor_inbox, lambda address, token: am.Ask(
                WorkerQuery(), address, token))
            facts = worker.facts
            if facts is None:  # it serves once started, unless its first worker failed
                raise WorkerStartFailed(f"the worker could not be started: {worker.failure}")
            core_config = SchedulerConfig.from_dict(
                {**cfg.scheduler, "kv_blocks": facts.num_blocks, "block_size": facts.block_size}
            )
            max_model_len = facts.max_model_len
            self._file_tenants = set(core_config.tenants)
            # which tenants a client may name is an intake limit; the tenants of CURVE keys
            # and API keys exist
            keyed = [*cfg.auth.tenants, *cfg.http.tenants]
            core_config = dataclasses.replace(
                core_config,
                tenants={**{name: core_config.tenant(name) for name in keyed},
                         **core_config.tenants},
                open_tenants=cfg.limits.open_tenants,
                default_tenant_max_queued=cfg.limits.default_tenant_max_queued)

            def make_core() -> Scheduler:
                return Scheduler(core_config, eos_token_ids=tokenizer.eos_token_ids,
                                 max_model_len=max_model_len, kv_window=facts.kv_window)

            self.usage = UsageLog(cfg.usage.path, limits=cfg.limits)
            usage_inbox = self._inboxes["usage"] = self.usage.inbox
            self.tokenizer = Tokenizer(tokenizer, scheduler=scheduler_inbox, limits=cfg.limits,
                                       usage=usage_inbox, max_model_len=max_model_len)
            tokenizer_inbox = self._inboxes["tokenizer"] = self.tokenizer.inbox
            codec = Codec(m.SERVER_MESSAGES, max_frame_bytes=cfg.limits.max_frame_bytes)
            client_codec = Codec(m.CLIENT_MESSAGES, max_frame_bytes=cfg.limits.max_frame_bytes,
                                 max_items=cfg.limits.max_frame_items)
            gateway_inbox = self._inboxes["gateway"] = Inbox("gateway")
            self.scheduler = SchedulerActor(make_core, tokenizer=tokenizer_inbox,
                                            executor=executor_inbox, inbox=scheduler_inbox,
                                            latency_histograms=cfg.metrics_port is not None)

            # one cache of checked grammars and one pool of processes checking them, for both
            # fronts: a ZeroMQ connection's Stream checks its requests' grammars, the HTTP
            # front its own before they reach its stream
            grammars = self._grammars = GrammarChecks(cfg.limits)

            def make_stream(connection: bytes) -> Stream:
                return Stream(connection, config=cfg.stream, codec=codec, gateway=gateway_inbox,
                              tokenizer=tokenizer_inbox, limits=cfg.limits, usage=usage_inbox,
                              grammars=grammars,
                              tenants_proven=cfg.auth.server_secret_key is not None)

            model_name = "embedded:" + self.model_path.name if cfg.model is None else str(cfg.model)
            if cfg.executor == "null":
                model_name = "null (fake tokens)"
            self.gateway = Gateway(cfg.listen, codec=client_codec, supervisor=self.supervisor,
                                   make_stream=make_stream,
                                   info=m.ServerInfo(m.PROTOCOL_VERSION, model_name, max_model_len),
                                   limits=cfg.limits,
                                   # the HTTP front, when on, takes the other half
                                   fd_share=1.0 if cfg.http.listen is None else 0.5,
                                   heartbeat_interval=cfg.stream.heartbeat_interval,
                                   heartbeat_timeout=cfg.stream.heartbeat_timeout,
                                   inbox=gateway_inbox, backlog_to=scheduler_inbox,
                                   usage=usage_inbox,
                                   curve_secret_key=cfg.auth.server_secret_key,
                                   tenant_keys={key: tenant
                                                for tenant, keys in cfg.auth.tenants.items()
                                                for key in keys},
                                   keyed_tenants=frozenset(
                                       tenant for table in (cfg.auth.tenants, cfg.http.tenants)
                                       for tenant, keys in table.items() if keys))
            fronts = [self.gateway]
            if cfg.http.listen is not None:
                http_inbox = self._inboxes["http"] = Inbox("http")

                # every HTTP request is a request of the front's one stream: its cap is the
                # front's, with room for requests cancelled whose ends are still on their way
                http_limits = dataclasses.replace(
                    cfg.limits, max_requests_per_connection=2 * cfg.http.max_concurrent_requests)

                def make_http_stream(connection: bytes, sink) -> Stream:
                    return Stream(connection, config=cfg.stream, codec=codec, gateway=http_inbox,
                                  tokenizer=tokenizer_inbox, limits=http_limits, sink=sink,
                                  usage=usage_inbox)

                # a response grants credits after taking half its window: a window above
                # the stream's clamp would wait for chunks that are never sent
                http_settings = dataclasses.replace(cfg.http, initial_credits=min(
                    cfg.http.initial_credits, cfg.limits.max_credits))
                self.http = HttpFront(http_settings, supervisor=self.supervisor,
                                      make_stream=make_http_stream, scheduler=scheduler_inbox,
                                      model_name=model_name, max_model_len=max_model_len,
                                      heartbeat_interval=cfg.stream.heartbeat_interval,
                                      reserved_fds=cfg.limits.reserved_fds, limits=cfg.limits,
                                      inbox=http_inbox, grammars=grammars)
                fronts.append(self.http)
            self.control = Control(cfg.control_address, scheduler=scheduler_inbox,
                                   hooks=self._control_hooks(gateway_inbox),
                                   facts=self._facts(model_name, core_config))
            control_inbox = self._inboxes["control"] = self.control.inbox
            for actor in (self.usage, self.scheduler, self.tokenizer, *fronts, self.control):
                await self.supervisor.start_child(actor)
            self.listen_address = await self._bound_address(gateway_inbox)
            self.control_address = await self._bound_address(control_inbox)
            if self.http is not None:
                self.http_address = await self._bound_address(self._inboxes["http"])
            if cfg.metrics_port is not None:
                await self._start_metrics(nursery)
            log.info("ready", listen=self.listen_address, control=self.control_address,
                     http=self.http_address, executor=cfg.executor, kv_blocks=facts.num_blocks)
            task_status.started(self)
            await self.stopped.wait()
            nursery.cancel_scope.cancel()

    def _facts(self, model_name: str, core_config: SchedulerConfig) -> m.DaemonFacts:
        """What this daemon runs, for its status: fixed from its start."""
        cfg = self.config
        settings = {f.name: getattr(core_config, f.name)
                    for f in dataclasses.fields(m.SchedulerSettings)}
        return m.DaemonFacts(version=version(), model=model_name,
                             model_path=str(self.model_path), executor=cfg.executor,
                             device=cfg.worker.device if cfg.executor == "model" else "",
                             scheduler=m.SchedulerSettings(**settings))

    async def _bound_address(self, actor: Inbox) -> str:
        endpoint = await self.questions.ask(actor, lambda address, token: am.Ask(
            EndpointQuery(), address, token))
        return endpoint.address

    async def _start_metrics(self, nursery: trio.Nursery) -> None:
        from sluice.daemon.metrics import Metrics, serve_metrics

        metrics = Metrics(self.metrics_snapshot, self.usage_snapshot)
        self.metrics_port = await nursery.start(serve_metrics, metrics, self.config.metrics_host,
                                                self.config.metrics_port)

    async def status(self, *, check_invariants: bool = False,
                     timeout: float = 10.0) -> m.StatusReport:
        """The scheduler's status report, asked by message."""
        snapshot = await self.questions.ask(self._scheduler_inbox, lambda address, token: am.Ask(
            m.StatusQuery(check_invariants), address, token), timeout)
        return snapshot.report

    async def metrics_snapshot(self):
        """What the console sees (status and detail) and the latency histograms, asked by
        message; for the metrics. Its status carries the edge's counters, as `sluice status`
        shows them: the gateway's, with the HTTP front's drain refusals."""
        snapshot = await self.questions.ask(
            self._scheduler_inbox, lambda address, token: am.Ask(MetricsQuery(), address, token),
            5.0)  # inside the 10 s a metrics scrape may take
        stats = snapshot.snapshot.status.gateway
        for name in ("gateway", "http"):
            if (inbox := self._inboxes.get(name)) is None:
                continue
            edge = await self.questions.ask(inbox, lambda address, token: am.Ask(
                am.ListConnections(), address, token), 5.0)
            if name == "gateway":
                stats = edge.stats
            else:
                stats = dataclasses.replace(
                    stats, drain_refusals=stats.drain_refusals + edge.stats.drain_refusals)
        status = dataclasses.replace(snapshot.snapshot.status, gateway=stats)
        return dataclasses.replace(
            snapshot, snapshot=dataclasses.replace(snapshot.snapshot, status=status))

    async def usage_snapshot(self):
        """The Usage actor's totals and request-timing histograms, for the metrics."""
        return await self.questions.ask(
            self._inboxes["usage"], lambda address, token: am.Ask(UsageQuery(), address, token),
            5.0)

    def reopen_usage_log(self) -> None:
        """SIGHUP: the usage file may have been rotated."""
        self._inboxes["usage"].put(am.ReopenUsageLog())

    async def summary(self) -> str:
        """One line for systemd's STATUS=."""
        try:
            report = await self.status(timeout=2.0)  # the watchdog ping waits behind this
        except trio.TooSlowError:
            return "scheduler not answering"
        req = report.requests
        worker = report.worker.state
        if report.worker.failure:
            worker += f" ({report.worker.failure[:120]})"
        return (f"{report.state}; worker {worker}; running {req.running}, "
                f"waiting {req.waiting}, paused {req.paused}; KV used {report.kv.used_blocks}/"
                f"{report.kv.total_blocks}")

    def reload_tenants(self, config: DaemonConfig) -> list[str]:
        """Make the tenants (weights, limits) what a re-read config says; their names.

        The file is the truth: a limit deleted from it is lifted, and a tenant deleted from it
        returns to the defaults. Tenants only ever set by an operator command are left alone.
        """
        tenants = SchedulerConfig.from_dict({**config.scheduler, "kv_blocks": 1}).tenants
        for name in self._file_tenants - set(tenants):
            self._scheduler_inbox.put(am.Operate(m.TenantSet(name, reset=True)))
        for name, tenant in tenants.items():  # no reply address: nobody waits for the answer
            self._scheduler_inbox.put(am.Operate(m.TenantSet(name, **dataclasses.asdict(tenant),
                                                           reset=True)))
        self._file_tenants = set(tenants)
        return sorted(tenants)

    def _control_hooks(self, gateway_inbox: Inbox) -> ControlHooks:
        faults = None
        if self.config.debug_faults:
            faults = {"worker_down": self._stop_worker,  # vanish_stream: the gateway's own
                      "oom_next_step": self._out_of_memory_next_step}
        return ControlHooks(gateway=gateway_inbox, tokenizer=self._inboxes["tokenizer"],
                            recover=self.recover, faults=faults, http=self._inboxes.get("http"))

    async def recover(self) -> str:
        """Restart the worker: replace a serving one, retry a failed one now, or start the
        executor again when it was stopped."""
        if self.supervisor.supervises(self.executor):
            self._inboxes["executor"].put(am.Recover())
            return "worker restarting; it serves once it passes its health check"
        # a model worker takes a while to load and verify: do not hold the control socket
        self._nursery.start_soon(self.supervisor.start_child, self.executor)
        return "worker starting; it serves once it passes its health check"

    async def _stop_worker(self) -> str:
        self.supervisor.stop_child(self.executor)
        with trio.fail_after(30):
            await self.supervisor.stopped(self.executor)
        self._scheduler_inbox.put(am.WorkerLost("worker stopped"))
        return "worker stopped"

    async def _out_of_memory_next_step(self) -> str:
        self._inboxes["executor"].put(InjectOutOfMemory())
        return "the worker's next step runs out of memory"

    def _make_executor(self, tokenizer, scheduler_inbox: Inbox) -> Actor:
        cfg = self.config
        if cfg.executor == "null":
            ids = [t for t in tokenizer.encode(cfg.null.text) if t not in tokenizer.eos_token_ids]
            facts = WorkerFacts(cfg.null.num_blocks, cfg.null.block_size, cfg.null.max_model_len,
                                tokenizer.vocab_size)
            return NullExecutor(scheduler=scheduler_inbox, token_cycle=ids, facts=facts)
        spec = cfg.worker
        if spec.model is None and cfg.model is not None:
            spec = dataclasses.replace(spec, model=cfg.model)
        if spec.runtime_dir is None:
            spec = dataclasses.replace(spec, runtime_dir=str(runtime_dir()))
        if spec.profile_tokens is None:  # the largest step the scheduler may plan
            core = SchedulerConfig.from_dict({**cfg.scheduler, "kv_blocks": 1})
            tokens = core.token_budget / min(core.prefill_weight, core.decode_weight)
            spec = dataclasses.replace(spec, profile_tokens=max(1, int(tokens)))
        return Executor(spec, scheduler=scheduler_inbox)

    async def drain(self, deadline: float | None = None) -> bool:
        """Stop admitting, wait for running requests (up to `deadline` s), then stop.

        Returns whether every request finished before the deadline; the rest are cancelled.
        """
        deadline = self.config.drain_deadline if deadline is None else deadline
        for front in ("gateway", "http"):
            if front in self._inboxes:
                self._inboxes[front].put(am.Drain())
        self._scheduler_inbox.put(am.Drain())
        finished = True
        with trio.move_on_after(deadline) as scope:
            while not await self._idle():
                await trio.sleep(0.05)
        if scope.cancelled_caught:
            finished = False
            # through the tokenizer, which ends the requests it still holds
            self._inboxes["tokenizer"].put(am.Operate(am.ReleaseAll()))
            with trio.move_on_after(2.0):  # cancelled requests' Finished need no credit
                while not await self._idle():
                    await trio.sleep(0.05)
        await trio.sleep(0.1)  # let the last Finished frames leave the gateway
        self.stopped.set()
        return finished

    async def _idle(self) -> bool:
        """No request is live anywhere: the scheduler, the tokenizer (tokenizing or waiting
        for the scheduler's answer) and every stream (its Finished not yet sent) hold none.

        A question that is not answered in time (an actor restarting, a stream going away
        while asked) means "not known to be idle": the caller asks again."""
        ask = self.questions.ask
        try:
            report = await self.status()
            live = report.requests
            if live.waiting or live.running or live.paused:
                return False
            held = await ask(self._inboxes["tokenizer"],
                             lambda address, token: am.Ask(am.Holding(), address, token))
            if held.requests:
                return False
            streams: list[str] = []
            for front in ("gateway", "http"):  # the streams of every front door
                if front in self._inboxes:
                    connections = await ask(self._inboxes[front], lambda address, token: am.Ask(
                        am.ListConnections(), address, token))
                    streams.extend(connections.streams)
            for stream in streams:
                outbox = self._stream_outboxes.get(stream)
                if outbox is None:
                    outbox = self._stream_outboxes[stream] = Outbox(stream)
                held = await ask(outbox, lambda address, token: am.Ask(
                    am.Holding(), address, token), timeout=1.0)
                if held.requests:
                    return False
        except trio.TooSlowError:
            return False
        return True

    def stop(self) -> None:
        self.stopped.set()
