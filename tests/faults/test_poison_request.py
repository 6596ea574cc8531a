"""A request whose step kills the worker every time: after a few worker restarts it ends with
an error instead of holding the daemon in a restart loop, and the daemon keeps serving."""

from __future__ import annotations

import pytest
import trio

from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status

pytestmark = pytest.mark.timeout(300)  # a hang fails this test instead of the suite

POISON = 40000  # a token id the worker is told to fail on (a test fault, never generated here)
CONFIG = f"""
[worker]
num_blocks = 128
threads = 1
backoff_initial = 0.05
debug_fail_token = {POISON}
"""


async def test_a_request_that_kills_every_worker_ends_with_an_error(
    daemon_process, drained_and_consistent, tmp_path
) -> None:
    config = tmp_path / "sluiced.toml"
    config.write_text(CONFIG)
    _, listen, control = daemon_process(
        ["--config", str(config), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock"], log=tmp_path / "sluiced.log")
    with trio.fail_after(240):
        async with AsyncClient(listen) as client:
            poisoned = await client.generate(prompt_ids=[1, 504, POISON, 282], max_tokens=4,
                                             temperature=0)
            result = await poisoned.collect()
            assert result.finish_reason == "error"
            status = await fetch_status(control)
            assert status.worker.restarts >= 2  # three workers lost: the first and two restarts
            healthy = await (await client.generate("The capital of France is", max_tokens=4,
                                                   temperature=0, ignore_eos=True)).collect()
            assert healthy.finish_reason == "length" and len(healthy.token_ids) == 4
    report = await drained_and_consistent(control)
    assert report.counters.accepted == 2
