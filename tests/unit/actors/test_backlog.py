"""Flow control by numbers in messages: the actors downstream report how many messages their
inbox still holds (`Backlog`), and the Scheduler plans no step while their sum is over its
limit, stepping again on the report that there is room."""

from __future__ import annotations

from sluice.actors.runtime import messages as am
from sluice.actors.runtime.base import Inbox
from sluice.actors.executor.protocol import PlanFrame, ResultFrame
from sluice.actors.executor.worker import decode_plan, encode_result
from sluice.actors.runtime.reports import Backlog, BacklogGauge
from sluice.actors.scheduler import Scheduler, SchedulerConfig
from sluice.actors.scheduler.plan import StepResult
from sluice.ipc.vocabulary import SamplingParams
from sluice.actors.scheduler.actor import SchedulerActor

from support.daemon import taken_from


class Recorder:
    def __init__(self) -> None:
        self.sent: list = []

    def put(self, msg) -> None:
        self.sent.append(msg)


def test_the_gauge_reports_moves_of_a_step_and_the_fall_to_zero() -> None:
    gauge, scheduler = BacklogGauge("gateway", step=16), Recorder()
    for depth in (1, 5, 15, 16, 20, 31, 32, 3, 0, 0, 7):
        gauge.report(depth, scheduler)
    assert scheduler.sent == [Backlog("gateway", 16), Backlog("gateway", 32),
                              Backlog("gateway", 3), Backlog("gateway", 0)]


async def test_the_scheduler_waits_for_room_downstream_then_steps_again() -> None:
    tokenizer, executor = Inbox("test-tokenizer"), Inbox("test-executor")
    config = SchedulerConfig.from_dict({"kv_blocks": 64, "block_size": 16})
    actor = SchedulerActor(lambda: Scheduler(config, eos_token_ids=[0], max_model_len=512),
                           tokenizer=tokenizer, executor=executor, worker_ready=True,
                           downstream_limit=100)
    try:
        actor.reset()
        taken_from(executor)  # the AskWorker of a fresh incarnation
        await actor.on_admit(am.Admit("r", b"", (5, 6, 7), SamplingParams(max_tokens=8), 0,
                                     "default", 0.0))
        [first] = [msg for msg in taken_from(executor) if isinstance(msg, PlanFrame)]
        await actor.on_backlog(Backlog("tokenizer", 80))
        await actor.on_backlog(Backlog("gateway", 40))  # 120 together: over the limit
        step_id = decode_plan(first.frame).step_id
        await actor.on_result_frame(ResultFrame(encode_result(
            StepResult(step_id, {"r": 9}))))
        assert not taken_from(executor), "no step while downstream is behind"
        await actor.on_backlog(Backlog("tokenizer", 32))  # 72: room again
        assert [msg for msg in taken_from(executor) if isinstance(msg, PlanFrame)]
        actor.core.abort("r")
        actor.core.check_invariants()
    finally:
        tokenizer.close()
        executor.close()
