"""What every test that drives a daemon shares: the KV checks, the record of which daemons a
test started and which of them it checked, and starting a `sluiced` process.

The fixtures over these live in `support/fixtures.py` (loaded for every folder by
`tests/conftest.py`). The rule they enforce: every daemon a test starts, in-process or as a
process, ends with the KV invariant checked — by the fixture at teardown while it still runs,
or, for a daemon that stops during the test (SIGTERM, SIGKILL, escalation), by the test
itself before it stops (`assert_drained_and_consistent` or `assert_consistent` on its control
address). A daemon that stopped unchecked fails the test.
"""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from sluice.ipc import messages as m
from sluice.ipc.control import fetch_status, fetch_status_sync


@dataclass
class StartedDaemon:
    """One daemon started during a test, as the KV-check record sees it."""

    control: str
    kind: str  # "in-process" | "process"
    process: subprocess.Popen | None = None
    stopped: bool = False  # an in-process daemon's run() returned or raised
    kept: bool = False  # a module/session fixture checks it at its own teardown
    checked: bool = False  # a KV check reached this daemon while it ran

    @property
    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return not self.stopped


@dataclass
class DaemonRecord:
    """Daemons started during the current test, each marked when a KV check reached it.

    A check counts for the daemon that answered it, never for another that used (or later
    uses) the same control address: it marks only the daemons running on that address now."""

    started: list[StartedDaemon] = field(default_factory=list)

    def start(self, daemon: StartedDaemon) -> StartedDaemon:
        self.started.append(daemon)
        return daemon

    def mark_checked(self, control: str) -> None:
        for daemon in self.started:
            if daemon.control == control and daemon.alive:
                daemon.checked = True

    def unchecked_and_stopped(self) -> list[StartedDaemon]:
        return [d for d in self.started if not d.kept and not d.alive and not d.checked]


RECORD = DaemonRecord()  # reset by the autouse fixture before each test


def _verdict(report: m.StatusReport) -> None:
    assert report.invariant_errors == (), report.invariant_errors
    kv = report.kv
    assert kv.free_blocks + kv.cached_blocks + kv.used_blocks == kv.total_blocks, kv


def _drained(report: m.StatusReport) -> bool:
    live = report.requests.waiting + report.requests.running + report.requests.paused
    return live == 0 and report.kv.used_blocks == 0


async def assert_drained_and_consistent(control: str, timeout: float = 30.0) -> m.StatusReport:
    """Wait until no request is live, then check the KV invariant and that no block leaked."""
    with trio.fail_after(timeout):
        while True:
            report = await fetch_status(control, check_invariants=True)
            if _drained(report):
                break
            await trio.sleep(0.1)
    _verdict(report)
    RECORD.mark_checked(control)
    return report


async def assert_consistent(control: str) -> m.StatusReport:
    """The KV invariant now, with requests possibly in flight (no leaked or doubly-owned
    block): for a daemon the test is about to stop before it could drain."""
    report = await fetch_status(control, check_invariants=True)
    _verdict(report)
    RECORD.mark_checked(control)
    return report


def assert_drained_and_consistent_sync(control: str, timeout: float = 30.0) -> m.StatusReport:
    """The blocking twin of `assert_drained_and_consistent`, for sync tests and teardowns."""
    end = time.monotonic() + timeout
    while True:
        report = fetch_status_sync(control, check_invariants=True)
        if _drained(report):
            break
        if time.monotonic() > end:
            raise AssertionError(f"the daemon at {control} did not drain in {timeout}s: "
                                 f"{report.requests}, {report.kv}")
        time.sleep(0.1)
    _verdict(report)
    RECORD.mark_checked(control)
    return report


def start_sluiced(args: list[str], *, env: dict[str, str] | None = None,
                  log: Path | None = None, log_level: str = "info",
                  timeout: float = 120.0) -> tuple[subprocess.Popen, dict[str, str]]:
    """Run `sluiced serve ARGS` and wait for its ready line.

    Returns (process, the ready line's fields: listen, control and maybe metrics)."""
    stderr = open(log, "w") if log is not None else subprocess.DEVNULL
    process = subprocess.Popen(
        [sys.executable, "-m", "sluice.daemon.main", "serve", *args],
        stdout=subprocess.PIPE, stderr=stderr, text=True,
        env={**os.environ, "SLUICE_LOG_LEVEL": log_level, **(env or {})},
    )
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    if not selector.select(timeout):
        process.kill()
        raise RuntimeError("sluiced did not become ready")
    line = process.stdout.readline()
    if not line.startswith("sluiced ready"):
        process.kill()
        raise RuntimeError(f"unexpected first line from sluiced: {line!r}")
    fields = dict(part.split("=", 1) for part in line.split()[2:])
    RECORD.start(StartedDaemon(fields["control"], "process", process=process))
    return process, fields


def start_daemon_process(
    args: list[str], *, timeout: float = 240.0, log: Path | None = None
) -> tuple[subprocess.Popen, str, str]:
    """Run `sluiced serve ARGS` and wait for its ready line; return (process, listen, control)."""
    process, fields = start_sluiced(args, log=log, log_level="warning", timeout=timeout)
    return process, fields["listen"], fields["control"]


def keep_for_scope(process: subprocess.Popen) -> None:
    """A module- or session-scoped fixture takes over the KV check of this process."""
    for daemon in RECORD.started:
        if daemon.process is process:
            daemon.kept = True


def waive_kv_check(process: subprocess.Popen, reason: str) -> None:
    """Exempt a daemon process the test kills where no KV check can reach it (a worker hung
    in a step holds the check back), saying why, rather than checking it idle beforehand."""
    assert reason, "a waived KV check says why"
    for daemon in RECORD.started:
        if daemon.process is process:
            daemon.checked = True


def stop_checked(process: subprocess.Popen, control: str) -> None:
    """Teardown of a process fixture: check a live daemon's KV, then kill it."""
    try:
        if process.poll() is None:
            assert_drained_and_consistent_sync(control)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


class NotifyListener:
    """The systemd side of sd_notify: a bound unix datagram socket."""

    def __init__(self, path):
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setblocking(False)
        self.seen: list[str] = []

    def drain(self) -> list[str]:
        while True:
            try:
                self.seen.extend(self.sock.recv(4096).decode().split("\n"))
            except BlockingIOError:
                return self.seen

    async def wait_for(self, line: str, count: int = 1, timeout: float = 20.0) -> None:
        with trio.fail_after(timeout):
            while self.drain().count(line) < count:
                await trio.sleep(0.02)


def taken_from(inbox) -> list:
    """Every message waiting in an actor's inbox, taken without waiting."""
    taken = []
    while True:
        try:
            taken.append(inbox.get_nowait())
        except trio.WouldBlock:
            return taken


async def http_get(port: int, path: str) -> tuple[int, str]:
    """GET http://127.0.0.1:port/path off the event loop: (status, body)."""
    import urllib.error
    import urllib.request

    def get() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    return await trio.to_thread.run_sync(get)


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
