"""Operator commands about the worker, on the shared real-model daemon with a real worker
process: a stopped worker leaves requests waiting (none lost), a worker loss names the KV
blocks no request owned before the pool resets, and `recover` starts a new worker that passes
its health check and finishes the waiting request with the offline engine's greedy tokens."""

from __future__ import annotations

import json

import pytest
import trio

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status, send_command

pytestmark = pytest.mark.timeout(300)  # a hang fails this test instead of the suite


async def wait_for(control: str, predicate, timeout: float = 120.0) -> m.StatusReport:
    with trio.fail_after(timeout):
        while True:
            report = await fetch_status(control)
            if predicate(report):
                return report
            await trio.sleep(0.05)


async def test_recover_after_a_worker_loss_on_a_real_worker(model_daemon, offline_greedy) -> None:
    control = model_daemon.control
    before = await wait_for(control, lambda r: r.worker.state == "ready")
    leaked = await send_command(control, m.InjectFault("leak_block"))
    block = int(leaked.message.split()[-1])
    assert (await send_command(control, m.InjectFault("worker_down"))).ok
    down = await wait_for(control, lambda r: r.worker.state != "ready")
    logged = [json.loads(line) for line in model_daemon.log.read_text().splitlines()
              if "owned by no request" in line]
    assert [event["blocks"] for event in logged][-1:] == [[block]]

    ids = offline_greedy.tokenizer.encode("The largest planet in the solar system is")
    with trio.fail_after(240):
        async with AsyncClient(model_daemon.listen, daemon_timeout=120) as client:
            waiting = await client.generate(prompt_ids=ids, max_tokens=6, temperature=0)
            await wait_for(control, lambda r: r.requests.waiting == 1)
            assert not waiting.done  # held, not failed, while no worker runs
            reply = await send_command(control, m.RecoverCommand())
            assert reply.ok, reply.message
            result = await waiting.collect()
    assert result.finish_reason == "length"
    assert list(result.token_ids) == offline_greedy(ids, 6)
    up = await wait_for(control, lambda r: r.worker.state == "ready")
    assert up.worker.pid not in (0, before.worker.pid)
    assert up.worker.restarts >= down.worker.restarts
    # the replacement runs what the first settled (`auto` measured once), on the same pool
    assert (up.worker.dtype, up.worker.kv_dtype) == (before.worker.dtype, before.worker.kv_dtype)
    assert up.kv.total_blocks == before.kv.total_blocks
