"""Poison-step bisection in the core: when steps keep losing the worker, only the request that
kills it fails; the requests batched with it are run apart and finish normally."""

from __future__ import annotations

from support.scheduler import req, sample_all

from sluice.actors.scheduler.plan import StepPlan
from sluice.ipc.vocabulary import FinishReason

ERROR = FinishReason.ERROR

POISON = 40_000  # a prompt token that "kills the worker" whenever a step computes it


def kills_worker(plan: StepPlan) -> bool:
    return any(POISON in seq.token_ids for seq in plan.seqs)


def run(sched, max_losses: int = 3, limit: int = 500):
    """Drive the core like the actor does; returns (finish reasons, lost plans)."""
    reasons: dict[str, FinishReason] = {}
    lost: list[StepPlan] = []
    for _ in range(limit):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        if kills_worker(plan):
            lost.append(plan)
            sched.requeue_all()
            outputs = sched.charge_lost_step(plan, max_losses)
        else:
            outputs = sched.update(plan, sample_all(plan))
        sched.check_invariants()
        reasons.update({o.request_id: o.finish_reason for o in outputs if o.finished})
    return reasons, lost


def poisoned(rid: str, **kwargs):
    request = req(rid, **kwargs)
    request.prompt_token_ids[2] = POISON
    return request


def test_only_the_poison_request_fails_and_its_batch_finishes(make_sched):
    sched = make_sched(max_prefill_chunk=64, max_prefilling=8)
    innocents = [f"ok{i}" for i in range(6)]
    for i, rid in enumerate(innocents[:3]):
        sched.add_request(req(rid, max_tokens=6, first=100 * (i + 1)))
    sched.add_request(poisoned("bad", max_tokens=6, first=5000))
    for i, rid in enumerate(innocents[3:]):
        sched.add_request(req(rid, max_tokens=6, first=1000 * (i + 1)))
    reasons, lost = run(sched)
    assert reasons == {"bad": ERROR, **{rid: FinishReason.LENGTH for rid in innocents}}
    assert len(lost[0].seqs) == 7  # they really were batched together
    for rid in innocents:
        assert sched.get_request(rid).output_token_ids == [7] * 6
    # bisection: a few more lost steps than the request's own three, not one per innocent
    assert len(lost) <= 1 + 2 + 3
    assert [s.request_id for s in lost[-1].seqs] == ["bad"]
    assert sched.bisection.suspects == {} and sched.bisection.solo_losses == {}
    assert sched.kv_cache.num_used_blocks == 0


def test_a_lone_poison_request_fails_after_max_losses(make_sched):
    sched = make_sched(max_prefill_chunk=64)
    sched.add_request(poisoned("bad", max_tokens=4))
    reasons, lost = run(sched, max_losses=3)
    assert reasons == {"bad": ERROR} and len(lost) == 3


def test_a_suspect_is_cleared_only_past_the_point_where_the_worker_died(make_sched):
    # the poison sits in the prompt's third chunk: early chunks succeed alone, yet the request
    # stays a suspect until it computed past the lost chunk, so it is never batched again
    sched = make_sched(max_prefill_chunk=4, max_prefilling=8)
    sched.add_request(req("ok", prompt_len=12, max_tokens=20, first=100))
    bad = req("bad", prompt_len=12, max_tokens=4, first=300)
    bad.prompt_token_ids[9] = POISON
    sched.add_request(bad)
    reasons, lost = run(sched)
    assert reasons == {"bad": ERROR, "ok": FinishReason.LENGTH}
    assert len(lost) == 1 + 3
    assert all([s.request_id for s in plan.seqs] == ["bad"] for plan in lost[1:])


def test_others_keep_running_while_a_suspect_is_paused(make_sched):
    sched = make_sched(max_prefill_chunk=64, max_prefilling=8)
    sched.add_request(req("a", max_tokens=30, first=100))
    sched.add_request(req("b", max_tokens=30, first=200))
    plan = sched.schedule()
    sched.requeue_all()
    assert sched.charge_lost_step(plan, 3) == []
    sched.pause("a")
    for _ in range(40):  # b is probed, cleared, and finishes while a stays paused
        plan = sched.schedule()
        sched.update(plan, sample_all(plan))
        sched.check_invariants()
    assert sched.get_request("b").finish_reason is FinishReason.LENGTH
    sched.resume("a")
    reasons, lost = run(sched)
    assert reasons == {"a": FinishReason.LENGTH} and lost == []
