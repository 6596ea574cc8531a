"""Policies over the same core: who is admitted next, and tenant limits."""

from __future__ import annotations

import pytest
from support.scheduler import req, step

from sluice.actors.scheduler import RequestState, TenantConfig
from sluice.ipc.vocabulary import QuotaError


def admitted_order(sched, n):
    order = []
    for _ in range(n):
        plan, _ = step(sched)
        order += [s.request_id for s in plan.seqs if s.start_pos == 0]
    return order


def test_priority_admits_higher_priority_first(make_sched):
    sched = make_sched(policy="priority", max_prefilling=1, max_prefill_chunk=64)
    sched.add_request(req("low", prompt_len=4, max_tokens=1, priority=0, arrival=0.0))
    sched.add_request(req("high", prompt_len=4, max_tokens=1, priority=9, arrival=1.0, first=50))
    sched.add_request(req("mid", prompt_len=4, max_tokens=1, priority=5, arrival=2.0, first=90))
    assert admitted_order(sched, 3) == ["high", "mid", "low"]


def test_priority_aging_lets_an_old_low_priority_request_go_first(make_sched, clock):
    sched = make_sched(policy="priority", max_prefilling=1, max_prefill_chunk=64, max_wait=10.0)
    sched.add_request(req("old-low", prompt_len=4, max_tokens=1, priority=0, arrival=0.0))
    clock.now = 11.0
    sched.add_request(
        req("new-high", prompt_len=4, max_tokens=1, priority=9, arrival=11.0, first=50)
    )
    assert admitted_order(sched, 2) == ["old-low", "new-high"]


def test_srpt_admits_the_shortest_job_first(make_sched):
    sched = make_sched(policy="srpt", max_prefilling=1, max_prefill_chunk=64, max_wait=None)
    sched.add_request(req("big", prompt_len=40, max_tokens=40, arrival=0.0))
    sched.add_request(req("small", prompt_len=4, max_tokens=2, arrival=1.0, first=100))
    sched.add_request(req("medium", prompt_len=10, max_tokens=10, arrival=2.0, first=200))
    assert admitted_order(sched, 3) == ["small", "medium", "big"]


def test_fair_alternates_by_weighted_service(make_sched):
    sched = make_sched(
        policy="fair",
        max_prefilling=1,
        max_running=1,
        max_prefill_chunk=64,
        max_wait=None,
        tenants={"a": TenantConfig(weight=3.0)},
    )
    for i in range(6):
        sched.add_request(
            req(f"a{i}", prompt_len=4, max_tokens=1, tenant="a", arrival=float(i), first=10 * i)
        )
        sched.add_request(
            req(
                f"b{i}",
                prompt_len=4,
                max_tokens=1,
                tenant="b",
                arrival=float(i),
                first=500 + 10 * i,
            )
        )
    order = admitted_order(sched, 8)
    # every request costs 5 service units; a at weight 3 gets three for each one of b's
    assert order == ["a0", "b0", "a1", "a2", "b1", "a3", "a4", "a5"]


def test_fair_newcomer_starts_at_the_current_minimum(make_sched):
    sched = make_sched(
        policy="fair", max_prefilling=1, max_running=1, max_prefill_chunk=64, max_wait=None
    )
    for i in range(4):
        sched.add_request(req(f"a{i}", prompt_len=8, max_tokens=1, tenant="a", first=10 * i))
    for _ in range(3):
        step(sched)
    a_time = sched.ledger.tenants["a"].virtual_time
    assert a_time > 0
    sched.add_request(req("b0", prompt_len=8, max_tokens=1, tenant="b", first=900))
    assert sched.ledger.tenants["b"].virtual_time == a_time
    # b gets no credit for having been idle: it alternates with a instead of running alone
    order = admitted_order(sched, 2)
    assert sorted(order) == ["a3", "b0"]


def test_tenant_max_running_holds_back_only_that_tenant(make_sched):
    sched = make_sched(
        policy="fcfs",
        max_prefilling=4,
        max_prefill_chunk=64,
        tenants={"t": TenantConfig(max_running=1)},
    )
    sched.add_request(req("t1", tenant="t", max_tokens=10, arrival=0.0))
    sched.add_request(req("t2", tenant="t", max_tokens=10, arrival=1.0, first=50))
    sched.add_request(req("u1", tenant="u", max_tokens=10, arrival=2.0, first=90))
    step(sched)
    states = {rid: sched.get_request(rid).state for rid in ("t1", "t2", "u1")}
    assert states == {
        "t1": RequestState.DECODING,
        "t2": RequestState.WAITING,
        "u1": RequestState.DECODING,
    }
    sched.abort("t1")
    step(sched)
    assert sched.get_request("t2").state is RequestState.DECODING


def test_tenant_limits_can_change_at_run_time(make_sched):
    sched = make_sched(policy="fair")
    sched.add_request(req("a1", tenant="t", max_tokens=10))
    sched.configure_tenant("t", TenantConfig(weight=4.0, max_new_tokens=5))
    with pytest.raises(QuotaError, match="max_tokens"):
        sched.add_request(req("a2", tenant="t", max_tokens=10, first=50))
    step(sched)
    assert sched.stats()["tenants"]["t"]["weight"] == 4.0
    # service is charged at the new weight: 8 prompt + 1 output tokens over weight 4
    assert sched.ledger.tenants["t"].virtual_time == 9 / 4.0
