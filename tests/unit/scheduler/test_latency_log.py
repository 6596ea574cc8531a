"""The scheduler's latency bookkeeping: the token rate `sluice status` shows, and the time
to first token and inter-token latency of each request, labelled by its tenant."""

from __future__ import annotations

from sluice.actors.scheduler import Request, Scheduler, SchedulerConfig, TenantConfig
from sluice.actors.scheduler.latency import LatencyLog
from sluice.actors.scheduler.plan import RequestOutput, StepOutputs
from sluice.ipc.vocabulary import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _core(clock: Clock, requests: int) -> Scheduler:
    config = SchedulerConfig(kv_blocks=4096, block_size=4, tenants={"paid": TenantConfig()},
                             max_running=requests)
    core = Scheduler(config, max_model_len=256, clock=clock)
    for i in range(requests):
        core.add_request(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=50),
                                 tenant="paid" if i % 2 else "guest"))
    return core


def test_the_token_rate_counts_every_token_of_a_busy_window() -> None:
    clock = Clock()
    core = _core(clock, 500)
    log = LatencyLog(histograms=True)
    for _ in range(10):  # 5,000 tokens in 10 steps, 2.5 times more outputs than it keeps
        clock.now += 0.1
        log.record(core, StepOutputs([f"r{i}" for i in range(500)], [7] * 500))
    assert log.output_tokens == 5000
    assert log.summary(clock.now, window=5.0)["tokens_per_second"] == 5000 / 5.0


def test_first_and_later_tokens_are_timed_and_labelled_by_tenant() -> None:
    clock = Clock()
    core = _core(clock, 2)
    log = LatencyLog(histograms=True)
    clock.now += 0.5
    log.record(core, StepOutputs(["r0", "r1"], [7, 7]))
    clock.now += 0.25
    log.record(core, StepOutputs(outputs=[RequestOutput("r0", [7, 8]),
                                          RequestOutput("r1", [7], finished=True)]))
    assert list(log.ttft) == [0.5, 0.5]
    assert list(log.itl) == [0.125, 0.25]  # two tokens in 0.25 s; one
    assert sum(log.buckets["itl", ""].counts) == 1  # r0: a tenant no config names
    assert sum(log.buckets["itl", "paid"].counts) == 1
    assert "r1" not in log.last_token and "r0" in log.last_token
