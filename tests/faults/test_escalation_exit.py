"""A `sluiced` process whose actor keeps crashing exits 70, the code systemd restarts on."""

from __future__ import annotations

import contextlib

import pytest
import trio

from sluice.actors.runtime.supervisor import RestartPolicy
from sluice.ipc import messages as m
from sluice.ipc.control import fetch_status, send_command
from sluice.ipc.errors import DaemonGone

from support.daemon import assert_consistent

pytestmark = pytest.mark.timeout(120)


async def _restarted(control: str) -> None:
    """Wait until a restarted scheduler answers a status with its invariant check."""
    while True:
        with contextlib.suppress(DaemonGone):  # between the crash and the restart
            if (await fetch_status(control, check_invariants=True, timeout=2)).worker.state \
                    == "ready":
                return
        await trio.sleep(0.05)


async def test_a_process_whose_scheduler_exhausts_its_restart_budget_exits_70(
    sluiced, tmp_path
) -> None:
    config = tmp_path / "sluiced.toml"
    config.write_text("[daemon]\ndebug_faults = true\n")
    control = f"ipc://{tmp_path}/control.sock"
    process, _ = sluiced(["--config", str(config), "--executor", "null",
                          "--listen", "tcp://127.0.0.1:0", "--control", control])
    budget = RestartPolicy().max_restarts
    with trio.fail_after(90):
        for _ in range(budget):  # each crash is restarted
            assert (await send_command(control, m.InjectFault("crash_scheduler"))).ok
            await _restarted(control)
        await assert_consistent(control)  # the next crash takes the daemon down: check first
        with contextlib.suppress(DaemonGone):  # it may be gone before the reply is delivered
            await send_command(control, m.InjectFault("crash_scheduler"), timeout=5)
        code = await trio.to_thread.run_sync(process.wait, 60)
    assert code == 70
