"""SIGTERM drains: no new admissions, running requests finish, exit code 0; a killed daemon
is noticed by its clients."""

from __future__ import annotations

import signal

import pytest
import trio
from support.daemon import assert_consistent

from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status
from sluice.ipc.errors import DaemonGone
from sluice.ipc.vocabulary import DrainingError


async def test_sigterm_drains_running_requests_and_exits_zero(tmp_path, daemon_process) -> None:
    process, listen, control = daemon_process(
        ["--executor", "null", "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock", "--drain-deadline", "30",
         "--pause-timeout", "60"],
        log=tmp_path / "sluiced.log",
    )
    with trio.fail_after(60):
        async with AsyncClient(listen, credit_window=1) as client:
            running = await client.generate("hi", max_tokens=300)
            async for _ in running:
                break  # it is running (soon paused by our slowness) when SIGTERM comes
            process.send_signal(signal.SIGTERM)
            while (await fetch_status(control)).state != "draining":
                await trio.sleep(0.02)
            # mid-drain, with the request still running: the daemon exits once it ends
            await assert_consistent(control)
            with pytest.raises(DrainingError):
                await client.generate("too late", max_tokens=2)
            async for _ in running:
                pass
            assert running.result.finish_reason == "length"
            assert len(running.result.token_ids) == 300
        code = await trio.to_thread.run_sync(process.wait)
    assert code == 0


async def test_client_learns_that_a_killed_daemon_is_gone(tmp_path, daemon_process) -> None:
    process, listen, control = daemon_process(
        ["--executor", "null", "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock", "--pause-timeout", "60"],
    )
    with trio.fail_after(60):
        async with AsyncClient(listen, credit_window=1, heartbeat_interval=0.2,
                               daemon_timeout=2.0) as client:
            generation = await client.generate("hi", max_tokens=1000)
            async for _ in generation:
                break
            await assert_consistent(control)  # the last look at its KV before it dies
            process.send_signal(signal.SIGKILL)
            with pytest.raises(DaemonGone):
                async for _ in generation:
                    pass
