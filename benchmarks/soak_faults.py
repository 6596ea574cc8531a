"""Faults the soak does to the daemon on a schedule: kill its worker process, stop the
worker through the control socket and recover it, drop a connection's stream.

The faults come through the daemon's debug fault injection (`debug_faults = true` in the
soak's config) and plain signals; each one's record says what was done and how long the
daemon took to serve again. Hostile clients are in `soak_hostile.py`.
"""

from __future__ import annotations

import os
import signal

import trio

from sluice.ipc import messages as m
from sluice.ipc.control import fetch_status, send_command
from sluice.ipc.vocabulary import SluiceError

from soak_daemon import DaemonProcess, worker_pid
from soak_wire import OWNERS, RawClient, Tally, generate

CHAOS_KINDS = ("kill_worker", "worker_down", "vanish_stream", "crash_scheduler")


async def _wait_worker_ready(control: str, old_pid: int, timeout: float) -> float | None:
    """Seconds until the worker is ready again (with a new pid, when it had one)."""
    started = trio.current_time()
    with trio.move_on_after(timeout):
        while True:
            await trio.sleep(0.2)
            try:
                report = await fetch_status(control, timeout=2.0)
            except SluiceError:
                continue
            if report.worker.state == "ready" and (old_pid == 0 or report.worker.pid != old_pid):
                return round(trio.current_time() - started, 2)
    return None


async def _vanish_a_decoy(daemon: DaemonProcess, decoy_tokens: int) -> dict:
    """Drop the stream of a decoy, a connection opened for it with one long request, so
    that the fault hits no client whose failures are counted. While hoarders hold every
    connection the daemon allows, the decoy is refused: it tries again for up to 30 s."""
    decoy = await _accepted_decoy(daemon.listen, decoy_tokens, 30.0)
    if decoy is None:
        return {"skipped": "no decoy connection was accepted within 30 s"}
    try:
        gone = await send_command(
            daemon.control, m.InjectFault("vanish_stream", target=decoy.identity.hex()),
            timeout=10.0)
        victim = gone.message.split()[-1]
        # what an operator does after a stream is lost: reconcile frees its requests
        fixed = await send_command(daemon.control, m.ReconcileCommand(), timeout=10.0)
    finally:
        decoy.close()
    return {"reply": gone.message, "victim": OWNERS.get(victim, "not a hostile connection"),
            "reconcile_findings": list(fixed.findings)}


async def _accepted_decoy(listen: str, tokens: int, timeout: float) -> RawClient | None:
    """A connection whose long request was accepted (it has a stream), or None."""
    with trio.move_on_after(timeout):
        while True:
            decoy = RawClient(listen, Tally("vanish_decoy"))
            decoy.send(generate("decoy", tokens, credits=1))
            with trio.move_on_after(3.0):
                while True:  # until it is accepted or refused, saying it is still here
                    answer = await decoy.read(0.5)
                    if any(isinstance(msg, m.Accepted) for msg in answer):
                        return decoy
                    if any(isinstance(msg, m.Rejected) for msg in answer):
                        break
                    decoy.send(m.Heartbeat())
            decoy.close()
            await trio.sleep(0.5)
    return None


async def inject(kind: str, daemon: DaemonProcess, recovery_timeout: float,
                 decoy_tokens: int, event: dict) -> None:
    """One fault; fills `event` as it goes with what it did and how long the daemon took to
    serve again, so that a fault cut short by the end of the soak still shows."""
    event["kind"] = kind
    try:
        if kind == "kill_worker":
            pid = worker_pid(daemon.pid)
            if pid is None:
                event["skipped"] = "no worker process (null executor)"
                return
            os.kill(pid, signal.SIGKILL)
            event["pid"] = pid
            event["ready_after_seconds"] = None  # until it is
            event["ready_after_seconds"] = await _wait_worker_ready(daemon.control, pid,
                                                                    recovery_timeout)
        elif kind == "worker_down":
            before = await fetch_status(daemon.control, timeout=5.0)
            down = await send_command(daemon.control, m.InjectFault("worker_down"), timeout=35.0)
            event["reply"] = down.message
            event["ready_after_seconds"] = None
            await trio.sleep(1.0)  # requests queue up behind the stopped worker meanwhile
            up = await send_command(daemon.control, m.RecoverCommand(), timeout=10.0)
            event["recover"] = up.message
            event["ready_after_seconds"] = await _wait_worker_ready(
                daemon.control, before.worker.pid, recovery_timeout)
        elif kind == "vanish_stream":
            event.update(await _vanish_a_decoy(daemon, decoy_tokens))
        elif kind == "crash_scheduler":  # the actor restarts; its requests end with error
            crashed = await send_command(daemon.control, m.InjectFault("crash_scheduler"),
                                         timeout=10.0)
            event["reply"] = crashed.message
            event["ready_after_seconds"] = await _wait_worker_ready(daemon.control, -1,
                                                                    recovery_timeout)
    except (SluiceError, OSError, trio.TooSlowError) as exc:
        event["error"] = f"{type(exc).__name__}: {exc}"


async def chaos(kinds: list[str], daemon: DaemonProcess, origin: float, interval: float,
                stop: trio.Event, events: list[dict], recovery_timeout: float,
                decoy_tokens: int) -> None:
    """Inject the selected faults in turn, one every `interval` seconds from `origin` (later
    when the one before took longer to recover), until `stop`."""
    turn = 0
    while kinds:
        with trio.move_on_at(origin + (turn + 1) * interval):
            await stop.wait()
        if stop.is_set() or not daemon.alive():
            return
        kind = kinds[turn % len(kinds)]
        turn += 1
        event = {"at": round(trio.current_time() - origin, 1)}
        events.append(event)
        await inject(kind, daemon, recovery_timeout, decoy_tokens, event)
