"""Cancel from every state releases every block the request holds, in that same call."""

from __future__ import annotations

from support.scheduler import req, sample_all, step

from sluice.actors.scheduler import RequestState
from sluice.ipc.vocabulary import FinishReason


def cancel_and_check(sched, rid, expected_state):
    request = sched.get_request(rid)
    assert request.state is expected_state
    used_before = sched.kv_cache.num_used_blocks
    held = len(request.block_ids)
    out = sched.abort(rid)
    assert out.finished and out.finish_reason is FinishReason.CANCELLED
    assert sched.kv_cache.num_used_blocks == used_before - held
    assert request.block_ids == [] and request.state is RequestState.CANCELLED
    assert rid not in sched.running and rid not in sched.paused and not request.in_queue
    sched.check_invariants()
    return held


def test_cancel_waiting(make_sched):
    sched = make_sched(max_prefilling=1)
    sched.add_request(req("a", prompt_len=40))
    sched.add_request(req("b", prompt_len=8, first=50))
    step(sched)
    cancel_and_check(sched, "b", RequestState.WAITING)
    assert len(sched.waiting) == 0


def test_cancel_prefilling(make_sched):
    sched = make_sched(block_size=4, max_prefill_chunk=8)
    sched.add_request(req("a", prompt_len=40))
    step(sched)
    assert cancel_and_check(sched, "a", RequestState.PREFILLING) == 2
    assert sched.kv_cache.num_used_blocks == 0


def test_cancel_decoding(make_sched):
    sched = make_sched(block_size=4)
    sched.add_request(req("a", prompt_len=9, max_tokens=20))
    step(sched)
    step(sched)
    assert cancel_and_check(sched, "a", RequestState.DECODING) == 3


def test_cancel_preempted(make_sched):
    sched = make_sched(
        block_size=2,
        kv_blocks=4,
        max_prefill_chunk=64,
        kv_high_watermark=1.0,
        kv_low_watermark=1.0,
        enable_prefix_caching=False,
    )
    sched.add_request(req("a", prompt_len=4, max_tokens=4, arrival=0.0))
    sched.add_request(req("b", prompt_len=4, max_tokens=4, arrival=1.0, first=50))
    step(sched)
    step(sched)  # both need a third block: b is preempted
    cancel_and_check(sched, "b", RequestState.PREEMPTED)


def test_cancel_paused(make_sched):
    sched = make_sched(block_size=4)
    sched.add_request(req("a", prompt_len=9, max_tokens=20))
    step(sched)
    sched.pause("a")
    assert cancel_and_check(sched, "a", RequestState.PAUSED) == 3


def test_cancel_while_its_step_runs_frees_now_and_the_result_is_dropped(make_sched):
    sched = make_sched(block_size=4)
    sched.add_request(req("a", prompt_len=9, max_tokens=20))
    sched.add_request(req("b", prompt_len=9, max_tokens=20, first=50))
    step(sched)
    plan = sched.schedule()
    cancel_and_check(sched, "a", RequestState.DECODING)
    outputs = sched.update(plan, sample_all(plan))
    assert [o.request_id for o in outputs] == ["b"]
    sched.check_invariants()
