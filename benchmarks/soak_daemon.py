"""The daemon under soak: its process, what /proc says about it, and the faults done to it.

`soak.py` starts `sluiced serve` here as a child process with a config that turns on debug
fault injection and short heartbeat and pause timeouts (so that what a hostile client
abandons is released within seconds), reads the memory of the daemon and of its worker from
`/proc`, watches whether it still answers, and breaks it on purpose at intervals (the chaos
schedule, in `soak_faults.py`). Clients, well-behaved or hostile, live elsewhere.
"""

from __future__ import annotations

import glob
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import trio
import zmq

from sluice.ipc import messages as m
from sluice.ipc.codec import Codec
from sluice.ipc.control import fetch_status
from sluice.ipc.vocabulary import SluiceError
from sluice.ipc.sockets import Socket

from soak_http import HTTP_KEYS, WEB_STRANGERS, WEB_TRICKLERS
from soak_wire import HOSTILE_TENANT

# small frames keep oversize probes cheap for this machine; a connection cap the hoarding
# clients can exceed without costing this machine many file descriptors
MAX_FRAME_BYTES = 1024 * 1024
MAX_CONNECTIONS = 64
# requests of the hostile tenant holding KV at once: what an operator would give a tenant it
# does not trust, a fraction of what the batch holds on each executor
HOSTILE_RUNNING = {"model": 8, "null": 64}

CONFIG = """
[daemon]
debug_faults = true
drain_deadline = 10.0

[stream]
heartbeat_interval = 0.5
heartbeat_timeout = 3.0
pause_timeout = 3.0

[limits]
max_frame_bytes = {max_frame_bytes}
max_connections = {max_connections}

[scheduler.tenants.{hostile_tenant}]
max_running = {hostile_running}
max_queued = 64
"""

# chunked prefill bounds a step by its token budget: on one CPU core a step of the default
# 512 tokens takes ~1.5 s, longer than a whole well-behaved request, so a burst of prompts
# (the hoarders send 64 at once) would stall every decode for seconds; 128 tokens is ~0.4 s
MODEL_CONFIG = """
[scheduler]
token_budget = 128

[worker]
num_blocks = 256
threads = 1
step_timeout = 60.0
startup_timeout = 240.0
"""

NULL_CONFIG = """
[null]
num_blocks = 4096
"""

# the HTTP front, when an http mode runs: a connection cap the flood passes twice over, a
# body read and a stalled write given up within seconds, and keys for three tenants, so that
# each holds at most half of the generations and of the body reads (16: the tricklers hold
# their share, and every other client's body fits beside it). The hostile tenants are
# capped as the ZeroMQ one is
HTTP_CONNECTIONS = 128
HTTP_BODY_READS = 32
HTTP_CONFIG = """
[http]
max_connections = {http_connections}
max_concurrent_requests = 64
max_body_reads = {body_reads}
read_timeout = 5.0
send_timeout = 6.0

[http.tenants]
{tenant_keys}
"""
HOSTILE_HTTP_TENANT = """
[scheduler.tenants.{tenant}]
max_running = {hostile_running}
max_queued = 64
"""


@dataclass
class DaemonProcess:
    process: subprocess.Popen
    listen: str
    control: str
    log_path: Path
    log_file: IO[str]
    http: str | None = None  # HOST:PORT of the HTTP front, when it runs

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None


def cpu_layout(executor: str, pin_worker: bool) -> dict:
    """Where each process runs. Pinned, the model worker gets the last CPU this process may
    use, and the daemon and the clients share the rest: the worker's core stands in for an
    accelerator, which a deployment's event loop and its clients (on other machines) do not
    share. Without pinning (or with one CPU, or the null executor) all share all."""
    cpus = sorted(os.sched_getaffinity(0))
    if executor != "model" or not pin_worker or len(cpus) < 2:
        return {"worker": None, "daemon_and_clients": cpus}
    return {"worker": cpus[-1:], "daemon_and_clients": cpus[:-1]}


def start_daemon(executor: str, folder: Path, layout: dict, *, listen: str = "tcp",
                 http: bool = False, timeout: float = 300.0) -> DaemonProcess:
    """Run `sluiced serve` on loopback with the soak config; return once it said ready.
    `listen`: its client address is tcp:// (any free port) or ipc:// (a socket in `folder`);
    `http`: the HTTP front runs too. Call it before any thread of this process starts: the
    daemon's CPUs are set here for this whole process, which the daemon inherits (the
    worker's come from the config)."""
    os.sched_setaffinity(0, layout["daemon_and_clients"])
    config = folder / "sluiced.toml"
    text = CONFIG.format(max_frame_bytes=MAX_FRAME_BYTES, max_connections=MAX_CONNECTIONS,
                         hostile_tenant=HOSTILE_TENANT,
                         hostile_running=HOSTILE_RUNNING[executor])
    if http:
        text += HTTP_CONFIG.format(
            http_connections=HTTP_CONNECTIONS, body_reads=HTTP_BODY_READS,
            tenant_keys="\n".join(f'{tenant} = ["{key}"]' for tenant, key in HTTP_KEYS.items()))
        text += "".join(HOSTILE_HTTP_TENANT.format(
            tenant=tenant, hostile_running=HOSTILE_RUNNING[executor])
            for tenant in (WEB_STRANGERS, WEB_TRICKLERS))
    if executor == "model":
        text += MODEL_CONFIG + (f"cpus = {layout['worker']}\n" if layout["worker"] else "")
    else:
        text += NULL_CONFIG
    config.write_text(text)
    log_path = folder / "sluiced.log"
    log_file = open(log_path, "w")
    address = f"ipc://{folder}/clients.sock" if listen == "ipc" else "tcp://127.0.0.1:0"
    process = subprocess.Popen(
        [sys.executable, "-m", "sluice.daemon.main", "serve", "--config", str(config),
         "--executor", executor, "--listen", address,
         "--control", f"ipc://{folder}/control.sock", *(["--http", "127.0.0.1:0"] * http)],
        stdout=subprocess.PIPE, stderr=log_file, text=True,
        env={**os.environ, "SLUICE_LOG_LEVEL": "info"},
    )
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    line = process.stdout.readline() if selector.select(timeout) else ""
    if not line.startswith("sluiced ready"):
        process.kill()
        log_file.close()
        raise RuntimeError(f"sluiced did not become ready (first line {line!r}); see {log_path}")
    fields = dict(part.split("=", 1) for part in line.split()[2:])
    return DaemonProcess(process, fields["listen"], fields["control"], log_path, log_file,
                         fields.get("http"))


def stop_daemon(daemon: DaemonProcess, timeout: float = 30.0) -> dict:
    """SIGTERM (a drain), then SIGKILL if it does not exit in time; how it ended."""
    try:
        return _stop(daemon, timeout)
    finally:
        daemon.log_file.close()


def _stop(daemon: DaemonProcess, timeout: float) -> dict:
    if not daemon.alive():
        return {"exit_code": daemon.process.returncode, "exited_before_stop": True}
    daemon.process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    try:
        code = daemon.process.wait(timeout=timeout)
        killed = False
    except subprocess.TimeoutExpired:
        daemon.process.kill()
        code, killed = daemon.process.wait(), True
    return {"exit_code": code, "killed_after_sigterm": killed,
            "stop_seconds": round(time.monotonic() - started, 2)}


# -- /proc -------------------------------------------------------------------------------------


def child_pids(pid: int) -> list[int]:
    """The children of a process, from every thread's `children` list."""
    kids: list[int] = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            kids += [int(x) for x in Path(path).read_text().split()]
        except (OSError, ValueError):
            continue  # a thread that ended while we looked
    return sorted(set(kids))


def worker_pid(daemon_pid: int) -> int | None:
    """The worker: the daemon's child whose command line runs sluice code."""
    for kid in child_pids(daemon_pid):
        try:
            cmdline = Path(f"/proc/{kid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"sluice" in cmdline:
            return kid
    return None


def rss_mib(pid: int | None) -> float | None:
    """VmRSS of a process in MiB (None when it is gone)."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def cpu_seconds(pid: int | None) -> float | None:
    """User plus system CPU time a process has used (a frozen daemon that burns CPU spins)."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)


def memory(daemon: DaemonProcess) -> dict:
    worker = worker_pid(daemon.pid)
    return {"daemon_rss_mib": rss_mib(daemon.pid), "worker_pid": worker,
            "worker_rss_mib": rss_mib(worker), "daemon_cpu_seconds": cpu_seconds(daemon.pid)}


@dataclass
class RssWatch:
    """The daemon's VmRSS once a second from its warm-up to its end: the baseline (taken when
    the hostile clients start), the peak from then on, the value after the settle, and a
    timeline of at most `points` samples for the report."""

    pid: int
    samples: list[tuple[float, float]] = field(default_factory=list)  # (trio clock, MiB)
    baseline_at: float | None = None
    end_at: float | None = None

    async def watch(self, interval: float = 1.0) -> None:
        while True:
            self._sample()
            await trio.sleep(interval)

    def _sample(self) -> float:
        now = trio.current_time()
        rss = rss_mib(self.pid)
        if rss is not None:
            self.samples.append((now, rss))
        return now

    def mark_baseline(self) -> None:
        self.baseline_at = self._sample()

    def mark_end(self) -> None:
        self.end_at = self._sample()

    def report(self, points: int = 40) -> dict:
        if self.baseline_at is None or not self.samples:
            return {}
        origin = self.baseline_at
        baseline = next((rss for at, rss in self.samples if at >= origin), None)
        after = [(at, rss) for at, rss in self.samples
                 if at >= origin and (self.end_at is None or at <= self.end_at)]
        peak_at, peak = max(after, key=lambda sample: sample[1])
        step = max(1, len(self.samples) // points)
        return {"baseline_mib": baseline, "peak_mib": peak,
                "peak_at_seconds": round(peak_at - origin),
                "end_mib": after[-1][1] if self.end_at is not None else None,
                "samples": len(self.samples),
                # [seconds from the baseline (negative: warm-up and quiet phase), MiB]
                "timeline": [[round(at - origin), rss] for at, rss in self.samples[::step]]}


# -- is it still answering? ---------------------------------------------------------------------

_client_codec = Codec(m.CLIENT_MESSAGES)
_server_codec = Codec(m.SERVER_MESSAGES)


async def describe_once(listen: str, timeout: float) -> float | None:
    """Seconds for a fresh connection's `Describe` to be answered; None past `timeout`."""
    started = trio.current_time()
    with Socket(zmq.DEALER) as sock:
        sock.connect(listen)
        with trio.move_on_after(timeout):
            await sock.send(_client_codec.encode(m.Describe()))
            while True:
                for msg in _server_codec.decode_batch(await sock.recv()):
                    if isinstance(msg, m.ServerInfo):
                        return trio.current_time() - started
    return None


@dataclass
class Liveness:
    """A `Describe` once a second over one connection (opened before any hostile client, so
    a connection cap never refuses it): no answer within the timeout starts a freeze."""

    probes: int = 0
    failed: int = 0
    freezes: list[dict] = field(default_factory=list)  # {"at": s into the run, "seconds": s}
    worst_answer_seconds: float = 0.0
    _frozen_since: float | None = None

    async def watch(self, listen: str, origin: float, stop: trio.Event,
                    timeout: float = 3.0) -> None:
        frame = _client_codec.encode(m.Describe())
        with Socket(zmq.DEALER) as sock:
            sock.connect(listen)
            while not stop.is_set():
                while sock.zmq.poll(0):  # a late answer to an earlier probe
                    sock.zmq.recv()
                started = trio.current_time()
                answer = None
                with trio.move_on_after(timeout):
                    await sock.send(frame)
                    while answer is None:
                        batch = _server_codec.decode_batch(await sock.recv())
                        if any(isinstance(msg, m.ServerInfo) for msg in batch):
                            answer = trio.current_time() - started
                self._record(answer, origin, timeout)
                with trio.move_on_after(1.0):
                    await stop.wait()

    def _record(self, answer: float | None, origin: float, timeout: float) -> None:
        now = trio.current_time()
        self.probes += 1
        if answer is None:
            self.failed += 1
            if self._frozen_since is None:
                self._frozen_since = now - timeout
                self.freezes.append({"at": round(self._frozen_since - origin, 1),
                                     "seconds": None})
        else:
            self.worst_answer_seconds = max(self.worst_answer_seconds, answer)
            self._close_freeze(now)

    def _close_freeze(self, now: float) -> None:
        if self._frozen_since is not None:
            self.freezes[-1]["seconds"] = round(now - self._frozen_since, 1)
            self._frozen_since = None

    def report(self) -> dict:
        return {"probes": self.probes, "unanswered": self.failed,
                "worst_answer_seconds": round(self.worst_answer_seconds, 3),
                "freezes": self.freezes, "frozen_at_end": self._frozen_since is not None}


@dataclass
class StatusWatch:
    """`status` with the KV check every few seconds while the soak runs: the invariant
    errors seen, and the most live connections the daemon reported.

    The errors are reported, not judged: the check is exact only between scheduler steps,
    and the daemon answers a status query while a step is in flight (see the README)."""

    checks: int = 0
    unanswered: int = 0
    with_invariant_errors: int = 0
    samples: list[str] = field(default_factory=list)  # the first few, cut to 300 characters
    peak_connections: int = 0
    # [seconds into the soak, daemon RSS, worker RSS, worker pid, worker state] once a
    # minute: memory that settles after the first minutes of hostile load is warm-up, memory
    # that keeps growing a leak. A worker is killed at intervals: its samples are compared
    # within one process, and only while it serves (one still loading is not smaller by leak)
    memory: list[list] = field(default_factory=list)

    async def watch(self, control: str, stop: trio.Event, interval: float = 2.5,
                    daemon: DaemonProcess | None = None) -> None:
        started = next_sample = trio.current_time()
        while not stop.is_set():
            with trio.move_on_after(interval):
                await stop.wait()
            if stop.is_set():
                return
            try:
                report = await fetch_status(control, check_invariants=True, timeout=3.0)
            except SluiceError:
                self.unanswered += 1
                continue
            if daemon is not None and trio.current_time() >= next_sample:
                now = memory(daemon)
                self.memory.append([round(trio.current_time() - started),
                                    now["daemon_rss_mib"], now["worker_rss_mib"],
                                    report.worker.pid, report.worker.state])
                next_sample += 60
            self.checks += 1
            self.peak_connections = max(self.peak_connections, report.connections)
            if report.invariant_errors:
                self.with_invariant_errors += 1
                if len(self.samples) < 3:
                    self.samples.append(report.invariant_errors[0][:300])

    def report(self) -> dict:
        return dict(self.__dict__)
