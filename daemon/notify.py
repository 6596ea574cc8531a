"""sd_notify: tell systemd (Type=notify) about readiness, status, liveness and shutdown.

`notify("READY=1")` and friends are no-ops outside systemd (no `NOTIFY_SOCKET`).
`keepalive` runs in the daemon's event loop: `WATCHDOG=1` at half the `WATCHDOG_USEC`
interval systemd asked for, and a one-line `STATUS=` now and then. Because it runs on the
trio thread, a stuck event loop stops the pings and systemd restarts the daemon.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Awaitable, Callable

import trio

STATUS_EVERY = 5.0  # seconds between STATUS= summaries


def notify(state: str) -> bool:
    """Send one datagram to `$NOTIFY_SOCKET`; False when not under systemd or it failed."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.sendto(state.encode(), address)
        except OSError:
            return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings: half of `$WATCHDOG_USEC`, or None when unset.

    `$WATCHDOG_PID`, when set, must be this process (systemd sets it for the main PID)."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(int(usec) / 2e6, 0.01)
    except ValueError:
        return None


def reloading() -> None:
    """`RELOADING=1` with the monotonic timestamp systemd wants since v253."""
    notify(f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")


async def keepalive(summary: Callable[[], Awaitable[str]]) -> None:
    """Ping the watchdog and publish `STATUS=await summary()` until cancelled.

    The summary is asked of the actors by message; the watchdog ping goes out first, so a
    scheduler that is slow to answer never costs the daemon its watchdog."""
    interval = watchdog_interval()
    if interval is None and not os.environ.get("NOTIFY_SOCKET"):
        return
    tick = min(interval or STATUS_EVERY, STATUS_EVERY)
    last_status = -STATUS_EVERY
    while True:
        if interval is not None:
            notify("WATCHDOG=1")
        now = trio.current_time()
        if now - last_status >= STATUS_EVERY:
            notify(f"STATUS={await summary()}")
            last_status = now
        await trio.sleep(tick)
