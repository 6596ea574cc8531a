"""The operator subcommands as scripts use them: exit codes, `--json` shapes, text output."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import trio

pytestmark = pytest.mark.timeout(240)  # a hang fails this test instead of the suite


async def sluice(*args: str) -> subprocess.CompletedProcess:
    return await trio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "sluice.daemon.cli", *args], capture_output=True, text=True,
        timeout=120))


async def test_operator_subcommands_drive_the_daemon(null_daemon, tmp_path) -> None:
    handle = await null_daemon(debug_faults=True)
    at = ("--connect-control", handle.control)
    with trio.fail_after(120):
        drained = await sluice("drain", *at, "--json")
        assert drained.returncode == 0, drained.stderr
        assert json.loads(drained.stdout)["command"] == "drain"
        assert (await handle.status()).state == "draining"
        resumed = await sluice("resume", *at)
        assert resumed.returncode == 0 and "admitting" in resumed.stdout

        changed = await sluice("tenants", *at, "set", "batch", "--weight", "2.5",
                               "--max-running", "3")
        assert changed.returncode == 0, changed.stderr
        listed = json.loads((await sluice("tenants", *at, "--json")).stdout)
        assert listed["batch"]["weight"] == 2.5
        assert listed["batch"]["limits"]["max_running"] == 3
        reset = await sluice("tenants", *at, "set", "batch", "--reset", "--max-queued", "9")
        assert reset.returncode == 0, reset.stderr
        listed = json.loads((await sluice("tenants", *at, "--json")).stdout)
        assert listed["batch"]["weight"] == 1.0
        assert listed["batch"]["limits"] == {
            "max_running": None, "max_queued": 9, "max_context": None, "max_new_tokens": None,
            "input_tokens_per_minute": None, "output_tokens_per_minute": None,
            "max_queue_wait": None, "max_kv_blocks": None, "max_priority": None,
            "timeout": None}
        table = (await sluice("tenants", *at)).stdout.splitlines()
        assert table[0].split()[:3] == ["tenant", "weight", "share"]
        limited = await sluice("tenants", *at, "set", "batch", "--output-tokens-per-minute",
                               "600", "--max-queue-wait", "2.5", "--max-priority", "3",
                               "--request-timeout", "30")
        assert limited.returncode == 0, limited.stderr
        listed = json.loads((await sluice("tenants", *at, "--json")).stdout)
        limits = listed["batch"]["limits"]
        assert (limits["output_tokens_per_minute"], limits["max_queue_wait"],
                limits["max_priority"], limits["timeout"], limits["max_queued"]) == (
            600, 2.5, 3, 30.0, 9)
        assert listed["batch"]["output_tokens_available"] == 600.0  # a full bucket
        assert listed["batch"]["input_tokens_available"] is None  # no input rate
        row = next(line for line in (await sluice("tenants", *at)).stdout.splitlines()
                   if line.startswith("batch"))
        assert "out/min=600(600)" in row and "max_priority=3" in row
        bad = await sluice("tenants", *at, "set", "batch", "--input-tokens-per-minute", "0")
        assert bad.returncode != 0 and "input_tokens_per_minute" in bad.stdout + bad.stderr

        missing = await sluice("cancel", "nope/1", *at, "--json")
        assert missing.returncode == 1 and json.loads(missing.stdout)["ok"] is False

        from sluice.ipc import messages as m
        from sluice.ipc.control import send_command

        await send_command(handle.control, m.InjectFault("leak_block"))
        reconciled = await sluice("reconcile", *at)
        assert reconciled.returncode == 0
        assert "found and fixed 1 discrepancy" in reconciled.stdout and "  - block " in reconciled.stdout

        nobody = await sluice("drain", "--connect-control", f"ipc://{tmp_path}/none.sock",
                              "--timeout", "0.5")
        assert nobody.returncode == 2 and "no answer" in nobody.stderr
