"""A model worker dies with the daemon, even when the daemon is killed while the worker is
stuck inside a step: a worker left behind would hold its memory (and a GPU) for nobody, and
a restarted daemon would start a second one beside it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status

from support.daemon import waive_kv_check

pytestmark = pytest.mark.timeout(300)

HANG = 40001  # a token id the worker is told to hang on (a test fault, never generated here)
CONFIG = f"""
[worker]
num_blocks = 64
threads = 1
step_timeout = 600.0
debug_hang_token = {HANG}
"""


def _gone(pid: int) -> bool:
    """No such process, or only its zombie left for whoever adopted it to reap."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


async def test_a_worker_stuck_in_a_step_dies_when_the_daemon_is_killed(
    daemon_process, tmp_path
) -> None:
    config = tmp_path / "sluiced.toml"
    config.write_text(CONFIG)
    process, listen, control = daemon_process(
        ["--config", str(config), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock"])
    worker = (await fetch_status(control)).worker.pid
    assert worker > 0 and not _gone(worker)
    waive_kv_check(process, "killed while its worker hangs in a step, which a KV check "
                            "would wait for; its pool dies with it")
    with trio.fail_after(120):
        async with AsyncClient(listen, daemon_timeout=60) as client:
            await client.generate(prompt_ids=[1, 504, HANG, 282], max_tokens=4, temperature=0)
            while (await fetch_status(control)).requests.running == 0:
                await trio.sleep(0.1)
            await trio.sleep(0.5)  # the step carrying the token is in the worker now
            process.kill()
            process.wait()
    deadline = time.monotonic() + 10
    while not _gone(worker) and time.monotonic() < deadline:
        await trio.sleep(0.1)
    if not _gone(worker):
        os.kill(worker, 9)  # do not leave it to the next test
        pytest.fail(f"worker {worker} outlived its killed daemon by 10 s")


def test_a_worker_whose_daemon_died_while_it_started_exits_at_once(tmp_path) -> None:
    # A daemon killed right after it spawned a worker leaves the worker adopted before it
    # looks at its parent: told the daemon's pid, it sees that parent gone, not a live one.
    gone_daemon = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_daemon.wait()
    worker = subprocess.run(
        [sys.executable, "-m", "sluice.actors.executor.worker",
         "--endpoint", f"ipc://{tmp_path}/never.sock", "--parent-pid", str(gone_daemon.pid)],
        timeout=60, capture_output=True)
    assert worker.returncode == 0, worker.stderr.decode()
    assert b"model" not in worker.stderr  # it did not load a model, nor log its start
