"""The Executor actor: owns the worker process and relays step plans and results.

Plans come already in the worker's encoding and results go to the Scheduler as the worker
wrote them (`protocol.PlanFrame`, `protocol.ResultFrame`): this actor forwards their bytes and
never decodes or re-encodes a step.

It spawns the worker, waits for its `hello`, verifies it with a known-answer forward (the
first worker's answer is the known one; every later worker must give the same), and only
then reports `WorkerReady`. When the process exits, or a step takes longer than
`step_timeout`, or the worker reports an error, the process is killed and the Scheduler is
told `WorkerLost`; a new worker is started with exponential backoff. A step that ran out of
memory is not an error: the worker's `StepOutOfMemory` goes to the Scheduler, which plans
that step again smaller, and the worker serves on. Each worker gets its
own ipc:// endpoint, so no late reply from a dead worker can be taken for a live one's.

A worker that fails `max_failed_starts` starts in a row puts the executor in the `failed`
state, which is a state and not a crash (a crash would let the supervisor restart the actor
and forget the count): the Scheduler is told `WorkerFailed`, and the executor retries every
`failed_retry_interval` seconds, or at once on `Recover`. At boot the daemon asks (`WorkerQuery`)
once `run` started; a first worker that never came has no facts, and the daemon exits with
its own code. `AskWorker` (from a restarted Scheduler) is answered with the current state.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import trio
import zmq

from sluice.actors.runtime import messages as am
from sluice.actors.runtime.base import Actor, Handler, Outbox, Outboxes
from sluice.actors.executor import worker
from sluice.actors.executor.memory import DEFAULT_KV_MEMORY_FRACTION
from sluice.actors.executor.protocol import (
    RESULT,
    HealthAnswer,
    HealthCheck,
    Hello,
    InjectOutOfMemory,
    PlanFrame,
    ResultFrame,
    StepOutOfMemory,
    WorkerError,
)
from sluice.actors.runtime.reports import WorkerFacts, WorkerQuery, WorkerState
from sluice.ipc.sockets import Socket

log = structlog.get_logger("sluice.executor")


def _first_leaf(exc: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups: the one worth a log line."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


class WorkerStartError(Exception):
    """A worker would not start or failed its health check too many times in a row."""


@dataclass(frozen=True)
class WorkerSpec:
    model: str | None = None  # path, or None for the embedded model
    dtype: str = "auto"  # weights: auto | float32 | bfloat16 | float16 (see executor/dtypes.py)
    kv_dtype: str = "auto"  # the KV pool; auto follows the weights
    device: str = "cpu"
    num_blocks: int | None = None  # None sizes the pool from memory, as below
    # the pool, when `num_blocks` is unset: this fraction of the memory left once the weights
    # are loaded and the largest step (`profile_tokens`) ran once — on CUDA the device's
    # free memory, on CPU what the process may still take (its cgroup's limit, MemAvailable)
    kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION
    # and at most this many bytes; None: no cap on CUDA, 1 GiB on CPU (see executor/memory.py:
    # host memory is everyone's, and 90% of a workstation's would be absurd for a CPU model)
    kv_max_bytes: int | None = None
    # tokens of the largest step, profiled at start; None: the scheduler's token_budget
    # (the daemon fills it in)
    profile_tokens: int | None = None
    block_size: int = 16
    max_model_len: int | None = None
    threads: int | None = None  # torch threads in the worker; unset with `cpus`: one per CPU
    # greedy output that does not depend on the rest of the batch, on how a prompt was
    # chunked or on the prefix cache: fixed matmul tiles and fixed-order attention, at a
    # cost in compute (see executor/model.py); CPU only
    deterministic: bool = False
    # CPUs the worker runs on (its matmul threads included); None: wherever the daemon may.
    # Pinned, the worker's threads and the daemon's event loop stop preempting each other
    cpus: tuple[int, ...] | None = None
    # rank processes the model is split across (torch.distributed, gloo on the CPU): the
    # worker is rank 0 and starts the others; `threads` and `cpus` are shared out among them
    tensor_parallel: int = 1
    # ranks on other hosts (`sluiced worker --join`): the IP address each of the group's last
    # ranks joins from, one per rank; they join at `join_listen` (tcp://HOST:PORT) over CURVE,
    # with the worker's secret key from `join_secret_key_file` and a client key listed in
    # `join_public_keys` (Z85)
    join_hosts: tuple[str, ...] = ()
    join_listen: str | None = None
    join_secret_key_file: str | None = None
    join_public_keys: tuple[str, ...] = ()
    runtime_dir: str | None = None  # where the worker's ipc socket lives
    startup_timeout: float = 300.0  # seconds for weights + pool + health check
    step_timeout: float = 300.0  # a step running longer means a hung worker
    max_failed_starts: int = 5  # failed starts in a row that make the worker `failed`
    backoff_initial: float = 0.2
    backoff_max: float = 5.0
    failed_retry_interval: float = 60.0  # seconds between retries in the `failed` state
    # a test fault: the worker fails every step that computes this token id
    debug_fail_token: int | None = None
    # a test fault: a worker exits before it says hello while this file exists
    debug_fail_start_if: str | None = None
    # a test fault: every worker after the first answers the health check with another token
    debug_wrong_health_on_restart: bool = False
    # a test fault: the worker hangs in every step that computes this token id
    debug_hang_token: int | None = None

    def __post_init__(self) -> None:
        fraction = self.kv_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not (
                0.0 < fraction <= 1.0):
            raise ValueError(f"worker.kv_memory_fraction: must be in (0, 1], got {fraction!r}")
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"worker.deterministic: must be true or false, got "
                             f"{self.deterministic!r}")
        if self.deterministic and self.device != "cpu":
            raise ValueError(f"worker.deterministic: runs on the CPU only, not on "
                             f"{self.device!r}")
        tp = self.tensor_parallel
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"worker.tensor_parallel: must be an integer >= 1, got {tp!r}")
        if tp > 1 and self.device != "cpu":
            raise ValueError(f"worker.tensor_parallel: above 1 runs on the CPU (gloo) for now, "
                             f"not on {self.device!r}")
        if tp > 1 and self.deterministic:
            raise ValueError("worker.tensor_parallel: the deterministic mode runs on one rank "
                             "only (set tensor_parallel = 1 or deterministic = false)")
        self._check_join()
        for name in ("kv_max_bytes", "profile_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"worker.{name}: must be an integer >= 1, got {value!r}")
        if self.cpus is None:
            return
        cpus = self.cpus
        valid = isinstance(cpus, (list, tuple)) and cpus and all(
            isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in cpus)
        if not valid:
            raise ValueError(f"worker.cpus: must be a non-empty list of CPU numbers, got {cpus!r}")
        present = os.cpu_count() or 1
        if missing := sorted(c for c in cpus if c >= present):
            raise ValueError(f"worker.cpus: no CPU {', '.join(map(str, missing))} on this "
                             f"machine (it has 0 to {present - 1})")
        object.__setattr__(self, "cpus", tuple(sorted(set(cpus))))


    def _check_join(self) -> None:
        import ipaddress

        hosts = self.join_hosts
        if not hosts:
            return
        if not isinstance(hosts, (list, tuple)):
            raise ValueError(f"worker.join_hosts: must be a list of IP addresses, got {hosts!r}")
        for host in hosts:
            try:
                ipaddress.ip_address(host)
            except (ValueError, TypeError):
                raise ValueError(f"worker.join_hosts: {host!r} is not an IP address (a rank's "
                                 "connection is checked against it)") from None
        if len(hosts) >= self.tensor_parallel:
            raise ValueError(f"worker.join_hosts: {len(hosts)} ranks on other hosts need "
                             f"tensor_parallel > {len(hosts)} (rank 0 is the worker), got "
                             f"{self.tensor_parallel}")
        listen = self.join_listen
        if not isinstance(listen, str) or not listen.startswith("tcp://") or ":" not in (
                listen.removeprefix("tcp://")):
            raise ValueError(f"worker.join_listen: ranks on other hosts join at a "
                             f"tcp://HOST:PORT address, got {listen!r}")
        if not self.join_secret_key_file:
            raise ValueError("worker.join_secret_key_file: ranks on other hosts join over "
                             "CURVE: name the file holding the worker's secret key")
        keys = self.join_public_keys
        if not keys or not all(isinstance(k, str) and len(k) == 40 for k in keys):
            raise ValueError("worker.join_public_keys: list the Z85 public keys (40 "
                             "characters each) of the ranks allowed to join")
        object.__setattr__(self, "join_hosts", tuple(hosts))
        object.__setattr__(self, "join_public_keys", tuple(keys))


class Executor(Actor):
    name = "executor"

    def __init__(self, spec: WorkerSpec, *, scheduler: Outbox):
        super().__init__()
        self.spec = spec
        self.scheduler = scheduler
        self.facts: WorkerFacts | None = None
        self.known_answer: int | None = None
        self.restarts = 0
        self.pid: int | None = None
        self.rank_pids: tuple[int, ...] = ()  # a tensor-parallel group's, rank 0 first
        self.state = "starting"  # starting | ready | restarting | failed
        # kept across restarts of this actor, so a crash cannot reset the count
        self.failed_starts = 0
        self.failure = ""  # the last failed start's reason
        self.out_of_memory_steps = 0  # steps the worker answered with StepOutOfMemory
        self._serial = itertools.count()
        self._runtime = Path(spec.runtime_dir or tempfile.mkdtemp(prefix="sluice-worker-"))
        self.askers = Outboxes()  # whoever asked for the worker's state (the daemon at boot)

    def reset(self) -> None:
        self._retry_now = trio.Event()  # set by `Recover`: stop waiting before a retry
        self.sock: Socket | None = None
        self.process: trio.Process | None = None
        self.step_started: float | None = None

    def handlers(self) -> dict[type, Handler]:
        return {PlanFrame: self.on_plan, am.AskWorker: self.on_ask_worker,
                am.Recover: self.on_recover, am.Ask: self.on_ask,
                InjectOutOfMemory: self.on_inject_out_of_memory}

    async def on_ask(self, msg: am.Ask) -> None:
        if isinstance(msg.query, WorkerQuery):
            self.askers.put(msg.reply_to, am.Reply(msg.token, WorkerState(
                self.state, self.facts, self.failure)))

    def close(self) -> None:
        super().close()
        self.askers.close()

    async def on_ask_worker(self, msg: am.AskWorker) -> None:
        if self.state == "ready":
            facts = self.facts
            self.scheduler.put(am.WorkerReady(self.restarts, self.pid or 0, facts.dtype,
                                             facts.kv_dtype, self.rank_pids))
        elif self.state == "failed":
            self.scheduler.put(am.WorkerFailed(self.failure, self.failed_starts, self.restarts))

    async def on_recover(self, msg: am.Recover) -> None:
        """Replace a serving worker; retry a failed or restarting one now."""
        if self.state == "ready":
            self.kill_worker()  # the loop starts a fresh worker and re-verifies it
        self._retry_now.set()

    async def background(self, nursery: trio.Nursery) -> None:
        await nursery.start(self._keep_worker)

    async def on_plan(self, plan: PlanFrame) -> None:
        if self.sock is None or self.state != "ready":
            return  # the scheduler learns of the lost worker and requeues
        self.step_started = trio.current_time()
        try:
            await self.sock.send(plan.frame)
        except (trio.ClosedResourceError, zmq.ZMQError):
            pass  # the worker is going away; the monitor reports it

    async def on_inject_out_of_memory(self, msg: InjectOutOfMemory) -> None:
        """A test fault: pass it on; a worker that is not serving has no next step to fail."""
        if self.sock is None or self.state != "ready":
            log.warning("out-of-memory fault dropped: no serving worker", state=self.state)
            return
        try:
            await self.sock.send(worker.encode(msg))
        except (trio.ClosedResourceError, zmq.ZMQError):
            pass

    def kill_worker(self) -> None:
        """Kill the current worker process and every process it started (a tensor-parallel
        group's other ranks, even stopped ones): fault tests and hung steps use this."""
        if self.process is not None and self.process.returncode is None:
            _kill_group(self.process)

    async def _keep_worker(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        backoff = self.spec.backoff_initial
        first = True
        if self.state == "ready":  # this actor crashed and restarts: that worker is gone
            self.state = "restarting"
        while True:
            self._retry_now = trio.Event()
            healthy = False
            reason = "worker stopped"
            try:
                async with trio.open_nursery() as nursery:
                    endpoint = f"ipc://{self._runtime}/worker-{os.getpid()}-{next(self._serial)}"
                    self.sock = Socket(zmq.PAIR)
                    self.sock.bind(endpoint)
                    # a process group of its own: a terminal's Ctrl-C goes to the daemon,
                    # which drains and then stops its worker
                    self.process = await trio.lowlevel.open_process(self._command(endpoint),
                                                                    process_group=0)
                    self.pid = self.process.pid
                    with trio.fail_after(self.spec.startup_timeout):
                        await self._handshake_unless_exited()
                    healthy = True
                    self.failed_starts, backoff = 0, self.spec.backoff_initial
                    self.failure = ""
                    self.state = "ready"
                    self.scheduler.put(am.WorkerReady(self.restarts, self.pid or 0,
                                                     self.facts.dtype, self.facts.kv_dtype,
                                                     self.rank_pids))
                    if first:
                        first = False
                        task_status.started()
                    nursery.start_soon(self._receive_results, nursery.cancel_scope)
                    nursery.start_soon(self._watch_steps)
                    await self.process.wait()
                    reason = f"worker exited with {self.process.returncode}"
                    nursery.cancel_scope.cancel()
            except* (trio.TooSlowError, WorkerStartError, zmq.ZMQError, OSError) as group:
                cause = _first_leaf(group)
                reason = f"worker failed: {type(cause).__name__}: {cause}"
            finally:
                await self._stop_process()
            log.warning("worker lost", reason=reason, restarts=self.restarts)
            wait = backoff
            if healthy:
                self.state = "restarting"
                self.scheduler.put(am.WorkerLost(reason))
            else:
                self.failed_starts += 1
                self.failure = reason
                if self.failed_starts >= self.spec.max_failed_starts:
                    if self.state != "failed":
                        log.error("worker failed: no start succeeded", reason=reason,
                                  attempts=self.failed_starts,
                                  retry_in=self.spec.failed_retry_interval)
                    self.state = "failed"
                    self.scheduler.put(am.WorkerFailed(reason, self.failed_starts, self.restarts))
                    wait = self.spec.failed_retry_interval
                    if first:
                        first = False
                        task_status.started()  # with no facts: the daemon gives up booting
                elif self.state != "failed":
                    self.state = "restarting"
            self.restarts += 1
            with trio.move_on_after(wait):
                await self._retry_now.wait()  # `Recover` cuts the wait short
            backoff = min(backoff * 2, self.spec.backoff_max)

    def _command(self, endpoint: str) -> list[str]:
        """The worker's command line. A replacement gets what the first worker settled:
        the dtypes `auto` chose (it measures, and a measurement can come out the other way)
        and the pool it sized (free memory moves). The scheduler's tables were made for
        those, so a worker that chose again would be refused as different; it also starts
        faster without profiling."""
        spec, facts = self.spec, self.facts
        dtype, kv_dtype, num_blocks = spec.dtype, spec.kv_dtype, spec.num_blocks
        if facts is not None:
            dtype, kv_dtype, num_blocks = facts.dtype, facts.kv_dtype, facts.num_blocks
        cmd = [sys.executable, "-m", "sluice.actors.executor.worker", "--endpoint", endpoint,
               "--dtype", dtype, "--kv-dtype", kv_dtype,
               "--device", spec.device, "--block-size", str(spec.block_size),
               "--parent-pid", str(os.getpid())]
        if spec.model is not None:
            cmd += ["--model", str(spec.model)]
        if num_blocks is not None:
            cmd += ["--num-blocks", str(num_blocks)]
        cmd += ["--kv-memory-fraction", repr(float(spec.kv_memory_fraction))]
        if spec.kv_max_bytes is not None:
            cmd += ["--kv-max-bytes", str(spec.kv_max_bytes)]
        if spec.profile_tokens is not None:
            cmd += ["--profile-tokens", str(spec.profile_tokens)]
        if spec.max_model_len is not None:
            cmd += ["--max-model-len", str(spec.max_model_len)]
        if spec.threads is not None:
            cmd += ["--threads", str(spec.threads)]
        if spec.deterministic:
            cmd += ["--deterministic"]
        if spec.cpus is not None:
            cmd += ["--cpus", ",".join(map(str, spec.cpus))]
        if spec.tensor_parallel > 1:
            cmd += ["--tensor-parallel", str(spec.tensor_parallel),
                    "--collective-timeout", repr(float(spec.step_timeout)),
                    "--group-timeout", repr(float(spec.startup_timeout))]
        if spec.join_hosts:
            cmd += ["--join-listen", spec.join_listen,
                    "--join-secret-key-file", str(spec.join_secret_key_file)]
            for host in spec.join_hosts:
                cmd += ["--join-host", host]
            for key in spec.join_public_keys:
                cmd += ["--join-public-key", key]
        if spec.debug_fail_token is not None:
            cmd += ["--debug-fail-token", str(spec.debug_fail_token)]
        if spec.debug_fail_start_if is not None:
            cmd += ["--debug-fail-start-if", spec.debug_fail_start_if]
        if spec.debug_hang_token is not None:
            cmd += ["--debug-hang-token", str(spec.debug_hang_token)]
        if spec.debug_wrong_health_on_restart and self.restarts > 0:
            cmd += ["--debug-health-offset", "1"]
        return cmd

    async def _handshake_unless_exited(self) -> None:
        """The handshake, cut short when the process dies first (it would never answer)."""
        process = self.process

        async def exited() -> None:
            await process.wait()
            raise WorkerStartError(f"worker exited with {process.returncode} before it was ready")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(exited)
            await self._handshake()
            nursery.cancel_scope.cancel()

    async def _handshake(self) -> None:
        hello = await self._receive()
        if not isinstance(hello, Hello):
            raise WorkerStartError(f"expected a Hello, got {_said(hello)}")
        facts = hello.facts
        self.rank_pids = tuple(hello.rank_pids)
        if self.facts is not None and facts != self.facts:
            raise WorkerStartError(f"worker came back different: {facts} != {self.facts}")
        await self.sock.send(worker.encode(HealthCheck()))
        answer = await self._receive()
        if not isinstance(answer, HealthAnswer):
            raise WorkerStartError(f"health check failed: {_said(answer)}")
        if self.known_answer is None:
            self.known_answer = answer.token
        elif answer.token != self.known_answer:
            raise WorkerStartError(
                f"health check answered {answer.token}, expected {self.known_answer}"
            )
        self.facts = facts
        log.info("worker ready", pid=self.pid, dtype=facts.dtype, kv_dtype=facts.kv_dtype,
                 kv_blocks=facts.num_blocks, **({"rank_pids": list(self.rank_pids)}
                                                if self.rank_pids else {}))

    async def _receive(self) -> object:
        return worker.decode(await self.sock.recv())

    async def _receive_results(self, scope: trio.CancelScope) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if frames[0] == RESULT and len(frames) == 2:
                self.step_started = None
                self.scheduler.put(ResultFrame(frames[1]))
                continue
            answer = worker.decode(frames[0])
            if isinstance(answer, StepOutOfMemory):
                self.step_started = None
                self.out_of_memory_steps += 1
                log.warning("worker step out of memory", step_id=answer.step_id,
                            total=self.out_of_memory_steps)
                self.scheduler.put(answer)
                continue
            log.error("worker reported a failure", message=_said(answer))
            self.kill_worker()
            return

    async def _watch_steps(self) -> None:
        while True:
            await trio.sleep(min(1.0, self.spec.step_timeout / 4))
            started = self.step_started
            if started is not None and trio.current_time() - started > self.spec.step_timeout:
                log.error("worker step timed out", seconds=self.spec.step_timeout)
                self.kill_worker()
                return

    async def _stop_process(self) -> None:
        if self.state == "ready":
            self.state = "restarting"
        self.step_started = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        process, self.process = self.process, None
        if process is not None:
            with trio.CancelScope(shield=True):
                if process.returncode is None:
                    _kill_group(process)
                with trio.move_on_after(10):
                    await process.wait()
                # a worker that died on its own leaves its other ranks: not for long
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)

    def teardown(self) -> None:
        self.kill_worker()

    async def on_crash(self, exc: BaseException) -> None:
        self.scheduler.put(am.WorkerLost(f"executor crashed: {type(exc).__name__}"))


def _kill_group(process: trio.Process) -> None:
    """SIGKILL a worker's process group (it leads its own: see `_keep_worker`)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()


def _said(msg: object) -> str:
    """A worker's unexpected message, for a log line or an error."""
    return msg.message if isinstance(msg, WorkerError) else f"a {type(msg).__name__}"
