"""A request that kills the worker, batched with innocent ones, on a real worker process: the
scheduler runs the lost step's requests apart (bisection), so only the poison request fails
and the others finish with the output they have without it."""

from __future__ import annotations

import pytest
import trio

from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status

pytestmark = pytest.mark.timeout(420)  # a hang fails this test instead of the suite

POISON = 40000  # a token id the worker is told to fail on (a test fault, never generated here)
CONFIG = f"""
[worker]
num_blocks = 128
threads = 1
backoff_initial = 0.05
debug_fail_token = {POISON}
"""
INNOCENT_PROMPTS = ([1, 504, 3458, 282, 2114], [1, 1780, 314, 253, 1345, 30])
# logits of one sequence move by up to ~0.1 with the batch it is computed in on a CPU (another
# GEMM blocking for another row count), so greedy tokens are compared up to the reference's
# first position whose best two tokens are closer than this
NEAR_TIE = 0.25


async def test_only_the_poison_request_fails_and_its_batch_finishes(
    daemon_process, drained_and_consistent, tmp_path
) -> None:
    config = tmp_path / "sluiced.toml"
    config.write_text(CONFIG)
    _, listen, control = daemon_process(
        ["--config", str(config), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock"], log=tmp_path / "sluiced.log")
    with trio.fail_after(400):
        async with AsyncClient(listen) as client:
            innocents = [await client.generate(prompt_ids=ids, max_tokens=24, temperature=0,
                                               ignore_eos=True) for ids in INNOCENT_PROMPTS]
            for generation in innocents:  # both decode: the poison's prefill joins their step
                await generation.__anext__()
            poisoned = await client.generate(prompt_ids=[1, 504, POISON, 282], max_tokens=4,
                                             temperature=0)
            assert (await poisoned.collect()).finish_reason == "error"
            results = [await generation.collect() for generation in innocents]
            assert [r.finish_reason for r in results] == ["length", "length"]
            status = await fetch_status(control)
            assert status.worker.restarts >= 3  # the batch was lost, then the poison alone
            # what the innocent prompts give without a poison request beside them
            again = [await client.generate(prompt_ids=ids, max_tokens=24, temperature=0,
                                           ignore_eos=True, top_logprobs=2)
                     for ids in INNOCENT_PROMPTS]
            expected = [await generation.collect() for generation in again]
    compared = 0
    for result, reference in zip(results, expected, strict=True):
        assert result.finish_reason == "length" and len(result.token_ids) == 24
        margins = [entry.top[0].logprob - entry.top[1].logprob for entry in reference.logprobs]
        clear = next((i for i, margin in enumerate(margins) if margin < NEAR_TIE), 24)
        assert result.token_ids[:clear] == reference.token_ids[:clear], (clear, margins)
        compared += clear
    assert compared >= 6  # the prompts were picked for clear starts
    assert sum(r.usage.recomputed_tokens for r in results) > 0  # they were in the lost steps
    report = await drained_and_consistent(control)
    assert report.counters.accepted == 5
