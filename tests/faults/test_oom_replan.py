"""A step that runs out of memory on a real worker does not cost the worker: the worker
answers that step with an out-of-memory result instead of dying (a test fault raises
torch's own out-of-memory error inside the forward, after the layers wrote their KV), the
scheduler plans it again with half the token budget, and greedy outputs are those of a run
without the fault — same worker process, no worker loss, one out-of-memory step counted."""

from __future__ import annotations

import json

import pytest
import trio

from sluice.actors.scheduler import SchedulerConfig
from sluice.actors.scheduler.step_budget import MIN_CHUNK
from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status, send_command

pytestmark = pytest.mark.timeout(300)  # a hang fails this test instead of the suite

PROMPTS = ("The capital of France is", "Water boils at a temperature of",
           "The three primary colors are", "In 1969 the first person to walk on the moon was")
MAX_TOKENS = 10


def log_events(model_daemon, event: str) -> list[dict]:
    lines = model_daemon.log.read_text().splitlines()
    return [json.loads(line) for line in lines if f'"{event}"' in line]


async def test_a_step_out_of_memory_is_planned_again_smaller_on_the_same_worker(
    model_daemon, offline_greedy
) -> None:
    control = model_daemon.control
    prompts = [offline_greedy.tokenizer.encode(text) for text in PROMPTS]
    expected = offline_greedy.batch(prompts, MAX_TOKENS)
    before = await fetch_status(control)
    assert before.worker.state == "ready"
    replans_before = len(log_events(model_daemon, "step out of memory: planned again smaller"))
    losses_before = len(log_events(model_daemon, "worker lost"))

    with trio.fail_after(240):
        async with AsyncClient(model_daemon.listen, daemon_timeout=120) as client:
            running = [await client.generate(prompt_ids=p, max_tokens=MAX_TOKENS,
                                             temperature=0) for p in prompts[:-1]]
            await running[0].__anext__()  # mid-run: the first token is out
            reply = await send_command(control, m.InjectFault("oom_next_step"))
            assert reply.ok, reply.message
            # a newcomer's prefill, so the next step exists whoever finishes first
            running.append(await client.generate(prompt_ids=prompts[-1], max_tokens=MAX_TOKENS,
                                                 temperature=0))
            results = [await generation.collect() for generation in running]

    assert all(r.finish_reason in ("length", "stop") for r in results)
    assert [list(r.token_ids) for r in results] == expected
    after = await fetch_status(control)
    assert after.worker.oom_steps == before.worker.oom_steps + 1
    assert (after.worker.pid, after.worker.restarts) == (before.worker.pid, before.worker.restarts)
    assert after.worker.state == "ready"
    replans = log_events(model_daemon, "step out of memory: planned again smaller")[replans_before:]
    assert len(replans) == 1
    assert replans[0]["token_budget"] < SchedulerConfig().token_budget  # a smaller step
    assert len(log_events(model_daemon, "worker lost")) == losses_before


@pytest.mark.parametrize("scheduler, restarts", [
    ({}, 0),  # planned again smaller on the same worker
    # a step as small as steps get that still runs out of memory takes the worker-failure
    # path: the worker is replaced and the step's requests recompute on the new one
    ({"token_budget": MIN_CHUNK}, 1),
])
async def test_under_the_null_executor_a_step_out_of_memory_is_planned_again(
        null_daemon, scheduler, restarts):
    handle = await null_daemon(debug_faults=True, scheduler=scheduler)
    before = await fetch_status(handle.control)
    with trio.fail_after(30):
        async with AsyncClient(handle.listen) as client:
            assert (await send_command(handle.control, m.InjectFault("oom_next_step"))).ok
            result = await (await client.generate("hello there", max_tokens=5)).collect()
    assert result.finish_reason == "length" and len(result.token_ids) == 5
    after = await fetch_status(handle.control)
    assert after.worker.oom_steps == before.worker.oom_steps + 1
    assert after.worker.restarts == before.worker.restarts + restarts
