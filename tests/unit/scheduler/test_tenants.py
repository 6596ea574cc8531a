"""Tenant isolation in the scheduler core: which tenants exist, salted prefix caching, queue
caps of unconfigured tenants, and pruning the scheduling state of idle tenants."""

from __future__ import annotations

import pytest
from support.scheduler import req, step

from sluice.actors.scheduler import Request
from sluice.actors.scheduler.commands import console_detail
from sluice.actors.scheduler.config import TenantConfig
from sluice.ipc.vocabulary import InvalidRequestError, QuotaError
from sluice.ipc.vocabulary import SamplingParams
from sluice.daemon.metrics import OTHER_TENANTS, bounded_tenants
from sluice.ipc.messages import LatencySummary
from sluice.ipc.vocabulary import FinishReason, RejectCode


def run_to_end(sched, limit=500):
    outputs = []
    for _ in range(limit):
        if not sched.has_unfinished():
            break
        outputs += step(sched)[1]
    return outputs


def prompt_request(rid: str, tenant: str) -> Request:
    # three full blocks of 4 plus two tokens: a hit would cover 12 tokens
    return Request(rid, list(range(100, 114)), SamplingParams(max_tokens=2), tenant=tenant)


def cached_tokens_of(sched, rid: str, tenant: str) -> int:
    sched.add_request(prompt_request(rid, tenant))
    (out,) = [o for o in run_to_end(sched) if o.finished]
    sched.check_invariants()
    return out.cached_tokens


# -- which tenants exist ----------------------------------------------------------------------


def test_closed_tenants_reject_a_name_nobody_created(make_sched):
    sched = make_sched(open_tenants=False, tenants={"batch": TenantConfig(weight=2.0)})
    unknown = "^invalid: tenant: 'heavy' is not a tenant"
    with pytest.raises(InvalidRequestError, match=unknown) as caught:
        sched.add_request(req("a", tenant="heavy"))
    assert caught.value.code is RejectCode.INVALID and caught.value.field == "tenant"
    # an invented name leaves nothing behind in the tenant tables
    assert "heavy" not in sched.ledger.usage and "heavy" not in sched.ledger.tenants
    sched.add_request(req("b", tenant="batch"))
    sched.add_request(req("c", first=50))  # "default" always exists
    run_to_end(sched)
    sched.check_invariants()


def test_a_tenant_that_is_not_a_name_is_invalid(make_sched):
    sched = make_sched()
    bad = req("a")
    bad.tenant = ["not", "a", "name"]
    with pytest.raises(InvalidRequestError, match="^invalid: tenant:"):
        sched.add_request(bad)
    sched.check_invariants()


def test_an_operator_created_tenant_is_accepted(make_sched):
    sched = make_sched(open_tenants=False)
    with pytest.raises(InvalidRequestError, match="^invalid: tenant:"):
        sched.add_request(req("a", tenant="night"))
    sched.configure_tenant("night", TenantConfig(weight=0.5))
    sched.add_request(req("b", tenant="night"))
    (out,) = [o for o in run_to_end(sched) if o.finished]
    assert out.finish_reason is FinishReason.LENGTH
    assert sched.ledger.usage["night"].finished == 1
    sched.check_invariants()


def test_open_tenants_accept_any_name(make_sched):
    sched = make_sched(open_tenants=True)
    sched.add_request(req("a", tenant="anyone"))
    run_to_end(sched)
    assert sched.ledger.usage["anyone"].finished == 1
    sched.check_invariants()


# -- prefix cache salted per tenant -----------------------------------------------------------


def test_the_same_prompt_from_another_tenant_gets_no_cache_hit(make_sched):
    sched = make_sched(block_size=4, max_prefill_chunk=64)
    assert cached_tokens_of(sched, "a1", "alpha") == 0
    assert cached_tokens_of(sched, "b1", "beta") == 0  # would reveal alpha's prompt otherwise
    assert cached_tokens_of(sched, "a2", "alpha") == 12  # the same tenant still hits
    assert cached_tokens_of(sched, "b2", "beta") == 12
    assert sched.kv_cache.num_used_blocks == 0


def test_tenants_that_opt_in_share_cache_hits(make_sched):
    sched = make_sched(
        block_size=4,
        max_prefill_chunk=64,
        tenants={
            "alpha": TenantConfig(share_prefix_cache=True),
            "beta": TenantConfig(share_prefix_cache=True),
            "gamma": TenantConfig(),
        },
    )
    assert cached_tokens_of(sched, "a1", "alpha") == 0
    assert cached_tokens_of(sched, "b1", "beta") == 12
    assert cached_tokens_of(sched, "g1", "gamma") == 0  # did not opt in: stays apart


def test_a_share_group_shares_only_inside_the_group(make_sched):
    sched = make_sched(
        block_size=4,
        max_prefill_chunk=64,
        tenants={
            "alpha": TenantConfig(prefix_cache_group="acme"),
            "beta": TenantConfig(prefix_cache_group="acme"),
            "gamma": TenantConfig(share_prefix_cache=True),
        },
    )
    assert cached_tokens_of(sched, "a1", "alpha") == 0
    assert cached_tokens_of(sched, "b1", "beta") == 12
    assert cached_tokens_of(sched, "g1", "gamma") == 0


def test_share_options_are_validated():
    with pytest.raises(ValueError, match="share_prefix_cache"):
        TenantConfig(share_prefix_cache="yes")
    with pytest.raises(ValueError, match="prefix_cache_group"):
        TenantConfig(prefix_cache_group="")


# -- queue caps -------------------------------------------------------------------------------


def test_a_tenant_without_its_own_cap_gets_the_default_queue_cap(make_sched):
    sched = make_sched(
        default_tenant_max_queued=3,
        max_running=1,
        max_prefilling=1,
        tenants={"big": TenantConfig(max_queued=5)},
    )
    for i in range(3):
        sched.add_request(req(f"u{i}", tenant="stranger", first=100 * i))
    with pytest.raises(QuotaError,
                       match=r"^quota: tenant: 'stranger' already has 3 requests queued"):
        sched.add_request(req("u3", tenant="stranger", first=900))
    assert sched.ledger.tenant_usage("stranger").rejected == 1
    for i in range(5):  # its own max_queued wins over the default
        sched.add_request(req(f"b{i}", tenant="big", first=2000 + 100 * i))
    with pytest.raises(QuotaError):
        sched.add_request(req("b5", tenant="big", first=9000))
    run_to_end(sched)
    sched.check_invariants()


# -- idle tenants keep no scheduling state ----------------------------------------------------


def test_many_one_off_tenants_leave_no_scheduling_state_but_keep_their_usage(make_sched):
    sched = make_sched(policy="fair", open_tenants=True, max_prefill_chunk=64, max_running=64)
    names = [f"once-{i}" for i in range(10_000)]
    for batch in range(0, len(names), 500):
        for name in names[batch : batch + 500]:
            sched.add_request(req(f"r-{name}", prompt_len=3, max_tokens=1, tenant=name))
        run_to_end(sched)
    sched.check_invariants()
    assert sched.ledger.tenants == {}  # no per-tenant scheduling state is left
    assert sched.waiting.tenants == frozenset()  # nor wait-queue heaps
    assert len(sched.ledger.usage) == len(names)  # while every tenant's usage is kept
    assert all(sched.ledger.usage[n].finished == 1 and sched.ledger.usage[n].prefill_tokens == 3 for n in names)
    stats = sched.stats()
    assert set(stats["tenants"]) == {"default"}  # snapshots stay bounded
    assert stats["other_tenants"]["finished"] == len(names)
    assert stats["other_tenants"]["prefill_tokens"] == 3 * len(names)
    # and so do the tenant label sets the metrics make of them
    series = bounded_tenants(console_detail(sched, latency=LatencySummary()))
    assert set(series) == {"default", OTHER_TENANTS}
    assert series[OTHER_TENANTS].totals.finished == len(names)


def test_a_returning_tenant_starts_at_the_current_minimum(make_sched):
    sched = make_sched(policy="fair", max_prefilling=1, max_running=1, max_wait=None)
    sched.add_request(req("a0", tenant="a", max_tokens=1))
    run_to_end(sched)
    assert "a" not in sched.ledger.tenants  # idle: its virtual counter is gone
    sched.add_request(req("b0", tenant="b", max_tokens=1, first=200))
    run_to_end(sched)
    sched.add_request(req("b1", tenant="b", max_tokens=5, first=300))
    step(sched)
    sched.add_request(req("a1", tenant="a", max_tokens=1, first=400))
    assert sched.ledger.tenants["a"].virtual_time == sched.ledger.tenants["b"].virtual_time
    run_to_end(sched)
    sched.check_invariants()


def test_stale_queue_entries_do_not_pile_up_under_a_long_waiting_request(make_sched):
    sched = make_sched(max_running=1, max_prefilling=1, max_prefill_chunk=64)
    sched.add_request(req("holder", tenant="t", max_tokens=1000, first=5000))
    step(sched)  # holder runs; everything below only waits and is cancelled
    sched.add_request(req("old", tenant="t", first=6000))  # stays queued throughout
    for i in range(2000):
        sched.add_request(req(f"c{i}", tenant="t", first=7000))
        sched.abort(f"c{i}")
    heap_sizes = [len(heap) for heap in sched.waiting._heaps.values()]
    assert max(heap_sizes) < 100 and len(sched.waiting._by_arrival) < 100
    sched.check_invariants()
    sched.abort("holder")
    run_to_end(sched)
    sched.check_invariants()


def test_usage_adds_up_over_active_and_idle_spells_without_double_counting(make_sched):
    sched = make_sched(open_tenants=True, tenants={"known": TenantConfig()})
    for spell in range(3):
        sched.add_request(req(f"o{spell}", prompt_len=5, max_tokens=2, tenant="visitor"))
        sched.add_request(req(f"k{spell}", prompt_len=5, max_tokens=2, tenant="known"))
        step(sched)
        active = sched.stats()
        assert active["tenants"]["visitor"]["configured"] is False
        assert active["tenants"]["visitor"]["prefill_tokens"] == 5 * (spell + 1)
        run_to_end(sched)
    stats = sched.stats()
    assert "visitor" not in stats["tenants"]
    other = stats["other_tenants"]
    assert other["finished"] == 3 and other["prefill_tokens"] == 15
    assert stats["tenants"]["known"]["finished"] == 3  # configured: its own entry, not summed
    assert sched.ledger.tenant_usage("visitor") == sched.ledger.usage["visitor"]
    assert sched.ledger.usage["visitor"].decode_tokens == 6
    sched.check_invariants()
