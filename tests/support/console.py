"""Helpers of the console tests: start a null daemon with fault injection on, run an async
test body on asyncio, and wait for the console to reach a state."""

from __future__ import annotations

import asyncio
from pathlib import Path

from support.daemon import start_daemon_process  # noqa: F401 (re-exported)


def start_console_daemon(folder: Path, name: str = "daemon", extra: str = ""):
    config = folder / f"{name}.toml"
    config.write_text(f"[daemon]\ndebug_faults = true\n{extra}")
    return start_daemon_process(
        ["--executor", "null", "--config", str(config), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{folder}/{name}.sock"], log=folder / f"{name}.log")


def drive(coroutine_fn):
    """Run an async console test body on asyncio, bounded so a hang fails instead."""
    async def bounded():
        return await asyncio.wait_for(coroutine_fn(), timeout=60)

    return asyncio.run(bounded())


async def wait_until(pilot, predicate, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError("the console did not reach the expected state")
        await pilot.pause(0.05)
