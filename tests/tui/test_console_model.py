"""The console on the real model and worker process: the worker is stopped, the console says
so, `w` + confirm brings a new worker through its health check, and generation resumes."""

from __future__ import annotations

import signal

import pytest
from support.console import drive, start_daemon_process, wait_until
from support.daemon import assert_drained_and_consistent_sync

from sluice.ipc import messages as m
from sluice.ipc.client import Client
from sluice.ipc.control import fetch_status_sync, send_command_sync
from sluice.tui.app import SluiceTop

pytestmark = pytest.mark.timeout(240)  # a hang fails this test instead of the suite

CONFIG = """
[daemon]
debug_faults = true
drain_deadline = 20.0

[worker]
num_blocks = 64
threads = 1
"""


def test_console_recovers_a_stopped_model_worker_and_serving_resumes(tmp_path) -> None:
    config = tmp_path / "sluiced.toml"
    config.write_text(CONFIG)
    process, listen, control = start_daemon_process(
        ["--config", str(config), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock"], log=tmp_path / "sluiced.log")
    try:
        first_pid = fetch_status_sync(control).worker.pid
        assert first_pid > 0
        assert send_command_sync(control, m.InjectFault("worker_down")).ok

        async def body():
            app = SluiceTop(control)
            async with app.run_test(size=(140, 48)) as pilot:
                await wait_until(pilot, lambda: app.snapshot is not None)
                assert app.snapshot.status.worker.state != "ready"
                assert "worker restarting" in app.query_one("#status").plain
                await pilot.press("w", "y")
                await wait_until(pilot, lambda: app.snapshot.status.worker.state == "ready",
                                 timeout=50)
                assert "worker ready" in app.query_one("#status").plain

        drive(body)
        report = fetch_status_sync(control)
        assert report.worker.pid not in (0, first_pid)
        with Client(listen) as client:
            result = client.generate("The capital of France is", max_tokens=4,
                                     temperature=0).collect()
        assert result.finish_reason == "length" and len(result.token_ids) == 4
        assert_drained_and_consistent_sync(control)
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
