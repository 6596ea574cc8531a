"""A worker step that hangs past `[worker] step_timeout` is killed and reported, with a real
worker process: the executor logs the timeout, a new
worker takes over, the request whose step hangs every worker ends with an error after a few
workers instead of holding the daemon, and the daemon keeps serving."""

from __future__ import annotations

import pytest
import trio

from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status

pytestmark = pytest.mark.timeout(300)  # a hang fails this test instead of the suite

HANG = 40001  # a token id the worker is told to hang on (a test fault, never generated here)
CONFIG = f"""
[worker]
num_blocks = 64
threads = 1
backoff_initial = 0.05
step_timeout = 2.5
debug_hang_token = {HANG}
"""


async def test_a_step_hung_past_step_timeout_is_killed_and_reported(
    daemon_process, drained_and_consistent, tmp_path
) -> None:
    config = tmp_path / "sluiced.toml"
    config.write_text(CONFIG)
    log = tmp_path / "sluiced.log"
    _, listen, control = daemon_process(
        ["--config", str(config), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock"], log=log)
    first = await fetch_status(control)
    with trio.fail_after(270):
        async with AsyncClient(listen, daemon_timeout=120) as client:
            hung = await client.generate(prompt_ids=[1, 504, HANG, 282], max_tokens=4,
                                         temperature=0)
            assert (await hung.collect()).finish_reason == "error"
            healthy = await (await client.generate("The capital of France is", max_tokens=4,
                                                   temperature=0, ignore_eos=True)).collect()
    assert healthy.finish_reason == "length" and len(healthy.token_ids) == 4
    assert log.read_text().count("worker step timed out") >= 1
    status = await fetch_status(control)
    assert status.worker.restarts >= first.worker.restarts + 2
    assert status.worker.pid != first.worker.pid and status.worker.state == "ready"
    await drained_and_consistent(control)
