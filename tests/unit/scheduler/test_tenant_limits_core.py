"""Tenant limits in the scheduler core: token rates, the KV cap, the priority clamp and
timeouts, each driven on a fake clock."""

from __future__ import annotations

import pytest
from support.scheduler import req, step

from sluice.actors.scheduler.config import ConfigError, TenantConfig
from sluice.ipc.vocabulary import QuotaError
from sluice.actors.scheduler.request import RequestState
from sluice.ipc.vocabulary import FinishReason, RejectCode

TICK = 0.05  # simulated seconds per step


def run_for(sched, clock, seconds: float) -> list:
    outputs = []
    end = clock.now + seconds
    while clock.now < end:
        clock.now += TICK
        outputs += sched.expire()
        outputs += step(sched, check=False)[1]
    sched.check_invariants()
    return outputs


def tenant_blocks(sched, name: str) -> int:
    return sum(len(r.block_ids) for r in sched.requests.values() if r.tenant == name)


@pytest.mark.parametrize("kind", ["input", "output"])
def test_a_token_rate_holds_within_ten_percent_under_a_flood(make_sched, clock, kind):
    rate = 1200  # tokens a minute
    limits = {f"{kind}_tokens_per_minute": rate}
    sched = make_sched(tenants={"m": TenantConfig(**limits)}, token_budget=256, max_running=64)
    # three times the rate: 2 requests of 30 tokens each kind, every second, for 4 minutes
    arrived = []
    for second in range(240):
        for i in range(2):
            rid = f"m{second}-{i}"
            sched.add_request(req(rid, prompt_len=30, max_tokens=30, tenant="m",
                                  first=10_000 * (second * 2 + i)))
            arrived.append(rid)
        sched.add_request(req(f"free{second}", prompt_len=30, max_tokens=30,
                              first=10 ** 9 + 100 * second))  # "default": no rate
        run_for(sched, clock, 1.0)
    admitted_at = {r.request_id: r.first_scheduled_time for r in
                   [*sched.requests.values(), *sched.recently_ended.values()]
                   if r.tenant == "m" and r.first_scheduled_time is not None}
    # after the first minute's burst, what is admitted per minute is the rate
    window = [t for t in admitted_at.values() if 60.0 <= t < 240.0]
    tokens_per_minute = len(window) * 30 / 3.0
    assert rate * 0.9 <= tokens_per_minute <= rate * 1.1
    # the burst: at most one minute's tokens admitted at once, at the start
    assert sum(t < 1.0 for t in admitted_at.values()) * 30 <= rate
    # the tenant without a rate was never held back
    assert all(sched.get_request(f"free{s}").state.is_ended for s in range(239))


def test_a_request_larger_than_its_bucket_is_refused_at_once(make_sched):
    sched = make_sched(tenants={"m": TenantConfig(input_tokens_per_minute=100,
                                                  output_tokens_per_minute=50)})
    with pytest.raises(QuotaError) as prompt:
        sched.add_request(req("big-prompt", prompt_len=101, max_tokens=1, tenant="m"))
    assert prompt.value.code is RejectCode.QUOTA and prompt.value.field == "prompt"
    with pytest.raises(QuotaError) as output:
        sched.add_request(req("big-output", prompt_len=4, max_tokens=51, tenant="m"))
    assert output.value.field == "max_tokens"
    sched.add_request(req("fits", prompt_len=100, max_tokens=50, tenant="m"))  # exactly fits


def test_a_wait_past_max_queue_wait_is_refused_with_a_retry_after(make_sched, clock):
    sched = make_sched(tenants={"m": TenantConfig(output_tokens_per_minute=600,
                                                  max_queue_wait=10.0)})
    for i in range(7):  # the burst (600) and one more that waits 10 s: all taken
        sched.add_request(req(f"r{i}", max_tokens=100, tenant="m", first=100 * i))
    with pytest.raises(QuotaError) as refused:
        sched.add_request(req("r7", max_tokens=100, tenant="m", first=700))
    assert refused.value.field == "tenant"
    assert refused.value.retry_after == pytest.approx(20.0)
    # once the queue ahead has been paid for, a request may wait again
    run_for(sched, clock, 12.0)
    sched.add_request(req("later", max_tokens=100, tenant="m", first=900))


def test_a_rate_lowered_below_a_queued_request_ends_it_at_once(make_sched, clock):
    sched = make_sched(tenants={"m": TenantConfig(output_tokens_per_minute=100)})
    sched.add_request(req("first", max_tokens=100, tenant="m", arrival=0.0))  # the minute's
    sched.add_request(req("big", max_tokens=80, tenant="m", first=200, arrival=0.01))
    sched.add_request(req("small", max_tokens=20, tenant="m", first=300, arrival=0.02))
    run_for(sched, clock, TICK)
    assert sched.get_request("first").first_scheduled_time is not None
    assert sched.get_request("big").state is RequestState.WAITING
    # 50 a minute can never take 80: it ends now, with the reason, and holds nothing
    outputs = sched.configure_tenant("m", TenantConfig(output_tokens_per_minute=50))
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("big", FinishReason.ERROR)]
    assert "lowered" in outputs[0].error and "max_tokens" in outputs[0].error
    assert sched.get_request("big").state.is_ended
    # the one already running and the one that still fits go on
    assert sched.get_request("first").state is RequestState.DECODING
    assert not sched.get_request("small").state.is_ended
    sched.check_invariants()


def test_unused_output_is_refunded_when_a_request_ends(make_sched, clock):
    sched = make_sched(tenants={"m": TenantConfig(output_tokens_per_minute=100)},
                       eos_token_ids=frozenset({7}))  # the first sampled token ends it
    sched.add_request(req("short", max_tokens=100, tenant="m"))
    outputs = run_for(sched, clock, 0.2)
    assert [o.finish_reason for o in outputs if o.finished] == [FinishReason.STOP]
    bucket = sched.ledger.rates.buckets["m"][1]
    bucket.refill(clock.now)
    assert bucket.level == pytest.approx(99 + 0.2 * 100 / 60, abs=0.5)  # 99 back, not 0
    sched.add_request(req("next", max_tokens=99, tenant="m", first=500))
    run_for(sched, clock, TICK)
    assert sched.get_request("next").first_scheduled_time is not None  # not held back


def test_the_kv_cap_is_never_exceeded_and_everyone_finishes(make_sched, clock):
    cap = 12
    sched = make_sched(block_size=4, kv_blocks=256, token_budget=64, max_running=32,
                       tenants={"capped": TenantConfig(max_kv_blocks=cap)})
    with pytest.raises(QuotaError):  # alone it needs more than the cap: it could never finish
        sched.add_request(req("huge", prompt_len=8, max_tokens=48, tenant="capped"))
    for i in range(10):  # each needs 8 + 16 tokens = 6 blocks at its end
        sched.add_request(req(f"c{i}", prompt_len=8, max_tokens=16, tenant="capped",
                              first=1000 * i, arrival=0.001 * i))
        sched.add_request(req(f"o{i}", prompt_len=8, max_tokens=16, first=10 ** 6 + 1000 * i))
    ended = {}
    for _ in range(2000):
        clock.now += TICK
        for out in step(sched)[1]:
            if out.finished:
                ended[out.request_id] = out
        assert tenant_blocks(sched, "capped") <= cap
        if not sched.has_unfinished():
            break
    assert len(ended) == 20
    assert {o.finish_reason for o in ended.values()} == {FinishReason.LENGTH}
    # growth beyond the cap preempted the tenant's own requests, never the other tenant's
    assert sum(o.preemptions for rid, o in ended.items() if rid.startswith("c")) > 0
    assert sum(o.preemptions for rid, o in ended.items() if rid.startswith("o")) == 0
    for rid in ended:
        assert len(sched.get_request(rid).output_token_ids) == 16
    assert sched.kv_cache.stats()["used_blocks"] == 0


def test_priority_above_the_clamp_is_lowered(make_sched):
    sched = make_sched(policy="priority", max_prefilling=1, max_running=1,
                       tenants={"low": TenantConfig(max_priority=2)})
    sched.add_request(req("loud", tenant="low", priority=9, arrival=0.0))
    sched.add_request(req("fair", priority=5, arrival=1.0, first=5000))
    assert sched.get_request("loud").priority == 2
    plan, _ = step(sched)
    assert [s.request_id for s in plan.seqs] == ["fair"]  # 5 outranks the clamped 2


def test_timeouts_end_work_in_every_state_and_free_its_blocks(make_sched, clock):
    sched = make_sched(max_running=3, max_prefilling=2, max_prefill_chunk=4, token_budget=8,
                       tenants={"t": TenantConfig(timeout=3.0)})
    # admitted in id order (one arrival time): the first three run, the last two wait
    sched.add_request(req("decoding", prompt_len=4, max_tokens=500, arrival=0.0,
                          timeout=2.0))
    sched.add_request(req("paused", prompt_len=4, max_tokens=500, arrival=0.0, first=9900,
                          timeout=2.5))
    sched.add_request(req("prefilling", prompt_len=400, max_tokens=4, arrival=0.0,
                          first=5000, timeout=2.0))
    sched.add_request(req("tenant-default", tenant="t", arrival=0.0, first=9500))
    sched.add_request(req("waiting", arrival=0.0, first=9000, timeout=2.0))
    for _ in range(5):
        clock.now += 0.1
        step(sched)
    sched.pause("paused")
    states = {rid: sched.get_request(rid).state for rid in
              ("decoding", "paused", "prefilling", "tenant-default", "waiting")}
    assert states == {"decoding": RequestState.DECODING, "paused": RequestState.PAUSED,
                      "prefilling": RequestState.PREFILLING,
                      "tenant-default": RequestState.WAITING, "waiting": RequestState.WAITING}
    assert sched.kv_cache.stats()["used_blocks"] > 0
    clock.now = 1.9
    assert sched.expire() == []
    clock.now = 2.0
    ended = {o.request_id: o.finish_reason for o in sched.expire()}
    assert ended == dict.fromkeys(("decoding", "prefilling", "waiting"), FinishReason.TIMEOUT)
    clock.now = 3.0
    ended = {o.request_id: o.finish_reason for o in sched.expire()}
    assert ended == dict.fromkeys(("paused", "tenant-default"), FinishReason.TIMEOUT)
    assert not sched.has_unfinished() and sched.next_deadline() is None
    sched.check_invariants()
    assert sched.kv_cache.stats()["used_blocks"] == 0


def test_limits_are_checked_when_configured(make_sched):
    for bad in ({"input_tokens_per_minute": 0}, {"max_queue_wait": -1.0},
                {"timeout": float("inf")}, {"max_priority": 1.5}, {"max_kv_blocks": -2}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            TenantConfig(**bad)


def test_a_paused_request_keeps_its_place_under_max_running(make_sched):
    # A client that stops reading pauses its request, which keeps its KV: the tenant's cap on
    # requests holding KV must not let another of its requests in beside it.
    sched = make_sched(tenants={"one": TenantConfig(max_running=1)}, max_running=8)
    sched.add_request(req("first", max_tokens=50, tenant="one", first=100))
    step(sched)
    assert sched.get_request("first").state is RequestState.DECODING
    sched.pause("first")
    sched.add_request(req("second", max_tokens=50, tenant="one", first=200))
    for _ in range(5):
        step(sched)
    assert sched.get_request("second").state is RequestState.WAITING
    assert sched.get_request("first").block_ids  # paused, holding its KV
    sched.resume("first")
    sched.abort("first")
    step(sched)
    assert sched.get_request("second").state in (RequestState.PREFILLING,
                                                 RequestState.DECODING)
    sched.check_invariants()
