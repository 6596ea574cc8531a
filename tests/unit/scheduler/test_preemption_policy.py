"""The preemption policy in the scheduler core: a cap on memory-pressure preemptions ends a
thrashing request, a higher-priority arrival takes the place of a lower one (not counted
against the cap), priority orders a tenant's queue under the fair policy, and recompute can
be charged to the tenant's fair share."""

from __future__ import annotations

import pytest
from support.scheduler import req, step

from sluice.actors.scheduler.config import ConfigError, SchedulerConfig, TenantConfig
from sluice.ipc.vocabulary import FinishReason


def run_to_end(sched, limit: int = 500) -> dict:
    ended = {}
    for _ in range(limit):
        if not sched.has_unfinished():
            break
        for out in step(sched)[1]:
            if out.finished:
                ended[out.request_id] = out
    assert not sched.has_unfinished()
    return ended


def thrashing(make_sched, max_preemptions):
    """Four requests growing to 6 blocks each in an 8-block pool: the youngest holders lose
    their blocks again and again as the older ones grow."""
    sched = make_sched(kv_blocks=8, block_size=4, max_preemptions=max_preemptions,
                       kv_high_watermark=1.0, kv_low_watermark=1.0)
    for i, name in enumerate(("a", "b", "c", "d")):
        sched.add_request(req(name, prompt_len=4, max_tokens=20, arrival=float(i),
                              first=1000 * i + 100))
    return sched, run_to_end(sched, limit=2000)


def test_the_cap_ends_a_thrashing_request_and_the_others_finish(make_sched):
    _, uncapped = thrashing(make_sched, None)
    assert max(out.preemptions for out in uncapped.values()) >= 2  # without a cap: thrash
    assert {out.finish_reason for out in uncapped.values()} == {FinishReason.LENGTH}
    sched, ended = thrashing(make_sched, 1)
    aborted = {rid for rid, out in ended.items()
               if out.finish_reason is FinishReason.PREEMPTED_ABORT}
    assert aborted and all(ended[rid].preemptions == 1 for rid in aborted)
    for rid in set(ended) - aborted:
        assert ended[rid].finish_reason is FinishReason.LENGTH
        assert len(sched.get_request(rid).output_token_ids) == 20
    assert sched.kv_cache.stats()["used_blocks"] == 0


def test_a_higher_priority_arrival_preempts_the_lowest_and_both_finish(make_sched):
    sched = make_sched(policy="priority", max_running=1, max_preemptions=0)
    sched.add_request(req("low", max_tokens=12, priority=0, arrival=0.0))
    for _ in range(3):
        step(sched)
    assert sched.get_request("low").block_ids  # it runs
    sched.add_request(req("high", max_tokens=4, priority=5, arrival=1.0, first=5000))
    plan, _ = step(sched)
    assert [s.request_id for s in plan.seqs] == ["high"]  # it took the one running place
    ended = run_to_end(sched)
    low, high = sched.get_request("low"), sched.get_request("high")
    assert ended["high"].finish_reason is ended["low"].finish_reason is FinishReason.LENGTH
    assert (len(low.output_token_ids), len(high.output_token_ids)) == (12, 4)
    # preempted for priority: counted apart, and not against a cap of 0
    assert (low.num_preemptions, low.num_priority_preemptions) == (1, 1)
    assert (sched.num_preemptions, sched.num_priority_preemptions) == (1, 1)
    assert sched.stats()["priority_preemptions"] == 1


def test_an_equal_or_lower_priority_arrival_waits(make_sched):
    sched = make_sched(policy="priority", max_running=1)
    sched.add_request(req("first", max_tokens=6, priority=3, arrival=0.0))
    step(sched)
    sched.add_request(req("same", max_tokens=2, priority=3, arrival=1.0, first=5000))
    sched.add_request(req("lower", max_tokens=2, priority=1, arrival=2.0, first=6000))
    plan, _ = step(sched)
    assert [s.request_id for s in plan.seqs] == ["first"]
    run_to_end(sched)
    assert sched.num_preemptions == 0


def test_priority_orders_a_tenant_s_queue_under_the_fair_policy(make_sched):
    sched = make_sched(policy="fair", max_running=1, max_prefilling=1)
    sched.add_request(req("busy", max_tokens=2, arrival=0.0))
    step(sched)
    sched.add_request(req("early-low", max_tokens=2, priority=0, arrival=1.0, first=5000))
    sched.add_request(req("late-high", max_tokens=2, priority=7, arrival=2.0, first=6000))
    admitted = []
    for _ in range(20):
        plan, _ = step(sched)
        admitted += [s.request_id for s in plan.seqs if s.request_id not in admitted
                     and s.request_id != "busy"]
    assert admitted == ["late-high", "early-low"]


@pytest.mark.parametrize("charge", [False, True])
def test_recompute_is_charged_to_the_fair_share_only_when_asked(make_sched, charge):
    sched = make_sched(kv_blocks=8, block_size=4, kv_high_watermark=1.0,
                       kv_low_watermark=1.0, charge_recompute=charge,
                       tenants={"t": TenantConfig()})
    for i, name in enumerate(("a", "b", "c")):
        sched.add_request(req(name, prompt_len=4, max_tokens=20, arrival=float(i),
                              first=1000 * i + 100, tenant="t"))
    run_to_end(sched, limit=2000)
    usage = sched.ledger.tenant_usage("t")
    assert usage.recomputed_tokens > 0
    fresh = usage.prefill_tokens + usage.decode_tokens
    assert usage.service == fresh + (usage.recomputed_tokens if charge else 0)


def test_the_policy_settings_are_checked():
    with pytest.raises(ConfigError, match="max_preemptions"):
        SchedulerConfig(max_preemptions=-1)
    with pytest.raises(ConfigError, match="charge_recompute"):
        SchedulerConfig(charge_recompute="yes")
