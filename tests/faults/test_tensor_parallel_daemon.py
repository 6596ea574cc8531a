"""A daemon whose worker is a tensor-parallel group (`[worker] tensor_parallel = 2`, CPU,
gloo) serves the embedded model's float32 greedy tokens as one process does, and fails as
one worker: a rank killed, or stopped inside a collective past the step deadline, brings the
whole group down and back, every in-flight request finishes once with the same tokens, no KV
is left held and no rank of the old group survives."""

from __future__ import annotations

import os
import signal

import pytest
import trio

from sluice.actors.engine import Engine
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status
from sluice.ipc.vocabulary import SamplingParams

pytestmark = pytest.mark.timeout(400)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small",
           "The three primary colours are"]
NEW_TOKENS = 24


def config_text(step_timeout: float = 300.0) -> str:
    return f"""
[worker]
tensor_parallel = 2
dtype = "float32"
num_blocks = 128
threads = 2
backoff_initial = 0.05
step_timeout = {step_timeout}
"""


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    """One process's float32 greedy tokens for PROMPTS (the in-process engine)."""
    engine = Engine(dtype="float32", num_blocks=128)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = [c.token_ids for c in engine.generate(PROMPTS, params)]
    engine.scheduler.check_invariants()
    return tokens


def gone(pid: int) -> bool:
    """No such process, or only its unreaped exit status."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


async def wait_gone(pids, seconds: float = 10.0) -> None:
    with trio.fail_after(seconds):
        while not all(gone(p) for p in pids):
            await trio.sleep(0.05)


def start(daemon_process, tmp_path, step_timeout: float = 300.0):
    config = tmp_path / "sluiced.toml"
    config.write_text(config_text(step_timeout))
    _, listen, control = daemon_process(
        ["--config", str(config), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock"], log=tmp_path / "sluiced.log")
    return listen, control


async def generate_while(listen: str, fault) -> list:
    """PROMPTS generated concurrently; `fault()` runs once every request has a token."""
    async with AsyncClient(listen, daemon_timeout=240) as client:
        generations = [await client.generate(p, max_tokens=NEW_TOKENS, temperature=0,
                                             ignore_eos=True) for p in PROMPTS]
        for generation in generations:
            async for _ in generation:
                break
        fault()
        return [await g.collect() for g in generations]


async def test_a_two_rank_group_serves_one_process_tokens_and_a_killed_rank_recomputes(
    daemon_process, drained_and_consistent, expected, tmp_path
) -> None:
    listen, control = start(daemon_process, tmp_path)
    first = await fetch_status(control)
    ranks = first.worker.rank_pids
    assert len(ranks) == 2 and ranks[0] == first.worker.pid and len(set(ranks)) == 2
    with trio.fail_after(300):
        async with AsyncClient(listen, daemon_timeout=240) as client:
            calm = [await (await client.generate(p, max_tokens=NEW_TOKENS, temperature=0,
                                                 ignore_eos=True)).collect() for p in PROMPTS]
        assert [r.token_ids for r in calm] == expected
        results = await generate_while(listen, lambda: os.kill(ranks[1], signal.SIGKILL))
    assert [r.finish_reason for r in results] == ["length"] * len(PROMPTS)
    assert [r.token_ids for r in results] == expected
    after = await fetch_status(control)
    assert after.worker.restarts == first.worker.restarts + 1
    assert after.worker.state == "ready" and not set(after.worker.rank_pids) & set(ranks)
    await wait_gone(ranks)  # the old group's rank 0 went with its rank 1
    await drained_and_consistent(control)


async def test_a_rank_stopped_inside_a_step_brings_the_group_down_at_the_step_deadline(
    daemon_process, drained_and_consistent, expected, tmp_path
) -> None:
    listen, control = start(daemon_process, tmp_path, step_timeout=3.0)
    first = await fetch_status(control)
    ranks = first.worker.rank_pids
    with trio.fail_after(300):
        # rank 1 stopped: rank 0 waits in the step's collective until the deadline
        results = await generate_while(listen, lambda: os.kill(ranks[1], signal.SIGSTOP))
    assert [r.finish_reason for r in results] == ["length"] * len(PROMPTS)
    assert [r.token_ids for r in results] == expected
    after = await fetch_status(control)
    assert after.worker.restarts >= first.worker.restarts + 1
    await wait_gone(ranks)  # the stopped rank was killed with its group, not left behind
    await drained_and_consistent(control)
