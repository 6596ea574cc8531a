"""A request's `Accepted` goes to the tokenizer with the outputs of the step in flight when it
was admitted, so that it reaches its client in the same frame as that step's chunks; it waits
`ACCEPTED_HOLD` at most, and goes at once when no step is in flight."""

from __future__ import annotations

import trio

from sluice.actors.runtime import messages as am
from sluice.actors.runtime.base import Inbox
from sluice.actors.executor.protocol import PlanFrame, ResultFrame
from sluice.actors.executor.worker import decode_plan, encode_result
from sluice.actors.scheduler import Scheduler, SchedulerConfig
from sluice.actors.scheduler.plan import StepResult
from sluice.ipc.vocabulary import SamplingParams
from sluice.actors.scheduler.actor import ACCEPTED_HOLD, SchedulerActor

from support.daemon import taken_from


def admit(rid: str) -> am.Admit:
    return am.Admit(rid, b"", (5, 6, 7), SamplingParams(max_tokens=8), 0, "default", 0.0)


def plans(executor: Inbox) -> list[PlanFrame]:
    return [msg for msg in taken_from(executor) if isinstance(msg, PlanFrame)]


async def test_an_admission_goes_with_the_step_in_flight_or_after_the_hold() -> None:
    tokenizer, executor = Inbox("test-tokenizer"), Inbox("test-executor")
    config = SchedulerConfig.from_dict({"kv_blocks": 64, "block_size": 16})
    actor = SchedulerActor(lambda: Scheduler(config, eos_token_ids=[0], max_model_len=512),
                           tokenizer=tokenizer, executor=executor, worker_ready=False)
    try:
        actor.reset()
        taken_from(executor)  # the AskWorker of a fresh incarnation
        async with trio.open_nursery() as nursery:
            await actor.background(nursery)
            # no worker, so no step in flight: the admission is told at once, alone
            await actor.on_admit(admit("a"))
            [alone] = taken_from(tokenizer)
            assert (alone.admitted, len(alone.outputs)) == ((("a", 3),), 0)

            await actor.on_worker_ready(am.WorkerReady(0))
            [first] = plans(executor)
            await actor.on_admit(admit("b"))  # while the step of "a" runs
            assert not taken_from(tokenizer), "held for the step in flight"
            step_id = decode_plan(first.frame).step_id
            await actor.on_result_frame(ResultFrame(encode_result(
                StepResult(step_id, {"a": 9}))))
            [outputs] = taken_from(tokenizer)
            assert outputs.admitted == (("b", 3),)  # with the outputs of that step
            assert ("a", 9) in zip(outputs.outputs.request_ids, outputs.outputs.token_ids)

            [second] = plans(executor)
            second_step = actor.in_flight
            await actor.on_admit(admit("c"))  # the step in flight never answers
            assert not taken_from(tokenizer)
            with trio.fail_after(5):
                while not (told := taken_from(tokenizer)):
                    await trio.sleep(ACCEPTED_HOLD / 2)
            assert [(msg.admitted, len(msg.outputs)) for msg in told] == [((("c", 3),), 0)]
            # the step is still in flight (no result came back for it), yet "c" was told
            assert second_step is not None and actor.in_flight is second_step
            nursery.cancel_scope.cancel()
        for rid in ("a", "b", "c"):
            actor.core.abort(rid)
        actor.core.check_invariants()
    finally:
        tokenizer.close()
        executor.close()
