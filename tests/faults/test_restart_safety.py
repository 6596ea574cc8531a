"""A restarted scheduler serves again: it asks the executor for the worker's state, ignores
late results of the plans its earlier incarnation sent, and its status tells the truth."""

from __future__ import annotations

import trio

from sluice.actors.runtime import messages as am
from sluice.actors.runtime.base import Inbox
from sluice.actors.executor.protocol import PlanFrame, ResultFrame
from sluice.actors.executor.worker import decode_plan, encode_result
from sluice.actors.scheduler import Scheduler, SchedulerConfig
from sluice.actors.scheduler.actor import SchedulerActor
from sluice.actors.scheduler.plan import StepPlan, StepResult
from sluice.ipc.vocabulary import SamplingParams
from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status, send_command

from support.daemon import taken_from


async def test_after_a_scheduler_crash_in_flight_requests_fail_and_new_ones_finish(
    null_daemon,
) -> None:
    handle = await null_daemon(debug_faults=True)
    with trio.fail_after(60):
        async with AsyncClient(handle.listen, credit_window=1) as client:
            in_flight = [await client.generate(f"before {i}", max_tokens=500) for i in range(3)]
            for generation in in_flight:  # each has produced tokens: it holds KV
                async for _ in generation:
                    break
            reply = await send_command(handle.control, m.InjectFault("crash_scheduler"))
            assert reply.ok
            for generation in in_flight:
                assert (await generation.collect()).finish_reason == "error"
            after = await client.generate("after the crash", max_tokens=8)
            result = await after.collect()
            assert result.finish_reason == "length"
            assert len(result.token_ids) == 8
        status = await fetch_status(handle.control, check_invariants=True)
        assert handle.daemon.supervisor.restarts["scheduler"] == 1
        assert status.worker.state == "ready"
        assert (status.requests.waiting, status.requests.running, status.requests.paused) == (
            0, 0, 0)
        assert status.invariant_errors == ()


def _actor() -> tuple[SchedulerActor, Inbox, Inbox]:
    tokenizer, executor = Inbox("test-tokenizer"), Inbox("test-executor")
    config = SchedulerConfig.from_dict({"kv_blocks": 64, "block_size": 16})
    actor = SchedulerActor(
        lambda: Scheduler(config, eos_token_ids=[0], max_model_len=512),
        tokenizer=tokenizer, executor=executor, worker_ready=True)
    return actor, tokenizer, executor


def _plans(inbox: Inbox) -> list[StepPlan]:
    """The plans the executor got, read as the worker reads them."""
    return [decode_plan(p.frame) for p in taken_from(inbox)
            if isinstance(p, PlanFrame)]


def _result(result: StepResult) -> ResultFrame:
    return ResultFrame(encode_result(result))


def _admit(rid: str) -> am.Admit:
    return am.Admit(rid, b"", (5, 6, 7), SamplingParams(max_tokens=4, temperature=0.0), 0,
                   "default", 0.0)


async def test_a_late_result_of_an_earlier_incarnations_plan_is_ignored() -> None:
    actor, tokenizer, executor = _actor()
    try:
        actor.reset()
        await actor.on_admit(_admit("old"))
        [old_plan] = _plans(executor)
        actor.reset()  # what the supervisor does after a crash: a fresh core, a new epoch
        taken_from(tokenizer)
        await actor.on_admit(_admit("new"))
        [new_plan] = _plans(executor)

        await actor.on_result_frame(_result(StepResult(old_plan.step_id,
                                                      {"old": 9})))
        assert actor.in_flight is not None, "a stale result must not end the step in flight"
        assert not [o for o in taken_from(tokenizer) if isinstance(o, am.StepOutputs)]

        await actor.on_result_frame(_result(StepResult(new_plan.step_id,
                                                      {"new": 9})))
        outputs = [msg.outputs for msg in taken_from(tokenizer) if isinstance(msg, am.StepOutputs)]
        # its token, in the columns of the requests that go on
        assert [(o.request_ids, o.token_ids, o.outputs) for o in outputs] == [(["new"], [9], [])]
        actor.core.abort("new")
        actor.core.check_invariants()
        assert actor.core.kv_cache.num_used_blocks == 0
    finally:
        tokenizer.close()
        executor.close()
