"""KV behaviour of the core: prefix cache, preemption and recompute, watermarks, pause, requeue."""

from __future__ import annotations

from support.scheduler import req, sample_all, step

from sluice.actors.scheduler import Request, RequestState
from sluice.ipc.vocabulary import SamplingParams


def run_to_end(sched, limit=500):
    outputs = []
    for _ in range(limit):
        if not sched.has_unfinished():
            break
        outputs += step(sched)[1]
    return outputs


def test_second_request_with_shared_prefix_reuses_cached_blocks(make_sched):
    sched = make_sched(block_size=4, max_prefill_chunk=64)
    shared = list(range(100, 112))  # three full blocks
    sched.add_request(Request("a", shared + [1, 2], SamplingParams(max_tokens=2)))
    run_to_end(sched)
    assert sched.kv_cache.num_cached_blocks >= 3
    sched.add_request(Request("b", shared + [3, 4, 5], SamplingParams(max_tokens=2)))
    plan, _ = step(sched)
    (seq,) = plan.seqs
    assert seq.start_pos == 12 and seq.token_ids == [3, 4, 5]
    assert sched.get_request("b").num_cached_tokens == 12
    out = run_to_end(sched)[-1]
    assert out.cached_tokens == 12
    assert sched.stats()["tenants"]["default"]["cached_tokens"] == 12


def test_cache_hit_leaves_at_least_one_prompt_token_to_compute(make_sched):
    sched = make_sched(block_size=4)
    prompt = list(range(200, 208))  # exactly two blocks
    sched.add_request(Request("a", prompt, SamplingParams(max_tokens=1)))
    run_to_end(sched)
    sched.add_request(Request("b", list(prompt), SamplingParams(max_tokens=1)))
    plan, _ = step(sched)
    (seq,) = plan.seqs
    assert seq.start_pos == 4 and seq.token_ids == prompt[4:] and seq.sample
    assert sched.get_request("b").num_cached_tokens == 4


def test_running_requests_share_prefix_blocks(make_sched):
    sched = make_sched(block_size=4, max_prefill_chunk=64)
    prefix = list(range(300, 308))
    sched.add_request(Request("a", prefix + [1], SamplingParams(max_tokens=50)))
    step(sched)
    sched.add_request(Request("b", prefix + [2], SamplingParams(max_tokens=50)))
    step(sched)
    a, b = sched.get_request("a"), sched.get_request("b")
    assert a.block_ids[:2] == b.block_ids[:2]
    assert sched.kv_cache.ref_count(a.block_ids[0]) == 2
    sched.abort("a")
    assert sched.kv_cache.ref_count(b.block_ids[0]) == 1
    sched.check_invariants()


def test_prefix_caching_off_computes_everything(make_sched):
    sched = make_sched(block_size=4, enable_prefix_caching=False)
    prompt = list(range(10, 22))
    sched.add_request(Request("a", prompt, SamplingParams(max_tokens=1)))
    run_to_end(sched)
    sched.add_request(Request("b", list(prompt), SamplingParams(max_tokens=1)))
    plan, _ = step(sched)
    assert plan.seqs[0].start_pos == 0
    assert sched.kv_cache.num_cached_blocks == 0


def test_decode_out_of_kv_preempts_lowest_priority_then_latest(make_sched, clock):
    sched = make_sched(
        block_size=2,
        kv_blocks=6,
        max_prefill_chunk=64,
        policy="priority",
        kv_high_watermark=1.0,
        kv_low_watermark=1.0,
        enable_prefix_caching=False,
    )
    sched.add_request(req("vip", prompt_len=4, max_tokens=8, priority=5, arrival=0.0))
    sched.add_request(req("old", prompt_len=4, max_tokens=8, arrival=1.0, first=50))
    sched.add_request(req("new", prompt_len=4, max_tokens=8, arrival=2.0, first=90))
    step(sched)  # 2 blocks each: the pool is full
    assert sched.kv_cache.num_available_blocks == 0
    step(sched)  # everyone needs a third block for position 3
    states = {rid: sched.get_request(rid).state for rid in ("vip", "old", "new")}
    assert states["new"] is RequestState.PREEMPTED
    assert states["vip"] is RequestState.DECODING and states["old"] is RequestState.DECODING
    assert sched.get_request("new").num_preemptions == 1
    assert sched.stats()["preemptions"] == 1


def test_preempted_request_recomputes_and_keeps_its_tokens(make_sched):
    sched = make_sched(
        block_size=2,
        kv_blocks=5,
        max_prefill_chunk=64,
        kv_high_watermark=1.0,
        kv_low_watermark=1.0,
        enable_prefix_caching=False,
    )
    sched.add_request(req("a", prompt_len=3, max_tokens=6, arrival=0.0, seed=9))
    sched.add_request(req("b", prompt_len=3, max_tokens=6, arrival=1.0, first=50, tenant="t"))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    recompute_chunks = []
    for i in range(40):
        if not sched.has_unfinished():
            break
        plan = sched.schedule()
        for seq in plan.seqs:
            if seq.request_id == "b" and tokens["b"] and seq.start_pos < 3 + len(tokens["b"]) - 1:
                recompute_chunks.append((seq, len(tokens["b"])))
        outputs = sched.update(plan, sample_all(plan, token=20 + i))
        sched.check_invariants()
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
    b = sched.get_request("b")
    assert b.num_preemptions >= 1
    assert recompute_chunks and recompute_chunks[0][0].start_pos == 0
    # the recompute covers the prompt and the generated tokens as one prompt
    known = b.prompt_token_ids + b.output_token_ids
    for seq, generated in recompute_chunks:
        end = seq.start_pos + len(seq.token_ids)
        assert seq.token_ids == known[seq.start_pos : end]
        assert seq.sample == (end == 3 + generated)
        assert seq.num_generated == generated
    assert len(tokens["a"]) == 6 and len(tokens["b"]) == 6
    assert b.output_token_ids == tokens["b"]
    assert b.num_recomputed_tokens > 0
    assert sched.ledger.usage["t"].recomputed_tokens == b.num_recomputed_tokens
    assert sched.ledger.usage["t"].preemptions == b.num_preemptions
    assert sched.kv_cache.num_used_blocks == 0


def test_high_watermark_stops_admission_until_below_low(make_sched):
    sched = make_sched(
        block_size=4,
        kv_blocks=10,
        kv_high_watermark=0.5,
        kv_low_watermark=0.3,
        max_prefill_chunk=64,
    )
    sched.add_request(req("a", prompt_len=20, max_tokens=16))  # 5 blocks = 50%
    step(sched)
    sched.add_request(req("b", prompt_len=4, max_tokens=2, first=60))
    step(sched)
    assert sched.get_request("b").state is RequestState.WAITING
    assert sched.stats()["kv"]["admission_open"] is False
    sched.abort("a")
    step(sched)
    assert sched.get_request("b").state is not RequestState.WAITING


def test_reserve_admission_never_preempts(make_sched):
    sched = make_sched(
        block_size=4,
        kv_blocks=8,
        admission="reserve",
        max_prefill_chunk=64,
        kv_high_watermark=1.0,
        kv_low_watermark=1.0,
    )
    for i in range(4):
        sched.add_request(req(f"r{i}", prompt_len=4, max_tokens=12, first=20 * i))  # 4 blocks each
    states = []
    while sched.has_unfinished():
        step(sched)
        states.append(sum(1 for r in sched.running.values()))
    assert max(states) == 2  # only two full reservations fit in eight blocks
    assert sched.num_preemptions == 0


def test_pause_keeps_kv_and_skips_decoding(make_sched):
    sched = make_sched(block_size=4)
    sched.add_request(req("a", max_tokens=10))
    sched.add_request(req("b", max_tokens=10, first=50))
    step(sched)
    held = list(sched.get_request("a").block_ids)
    sched.pause("a")
    plan, _ = step(sched)
    assert [s.request_id for s in plan.seqs] == ["b"]
    a = sched.get_request("a")
    assert a.state is RequestState.PAUSED and a.block_ids == held
    sched.resume("a")
    plan, _ = step(sched)
    assert sorted(s.request_id for s in plan.seqs) == ["a", "b"]


def test_requeue_all_recomputes_everyone_keeping_generated_tokens(make_sched):
    sched = make_sched(block_size=4, max_prefill_chunk=64)
    sched.add_request(req("a", prompt_len=6, max_tokens=10))
    sched.add_request(req("b", prompt_len=6, max_tokens=10, first=50))
    sched.add_request(req("c", prompt_len=6, max_tokens=10, first=90))
    for _ in range(3):
        step(sched)
    sched.pause("c")
    requeued = sched.requeue_all()
    assert sorted(requeued) == ["a", "b", "c"]
    assert sched.kv_cache.num_used_blocks == 0 and sched.kv_cache.num_cached_blocks == 0
    sched.check_invariants()
    a = sched.get_request("a")
    assert a.state is RequestState.PREEMPTED and a.output_token_ids == [7, 7, 7]
    plan, _ = step(sched)
    seq = next(s for s in plan.seqs if s.request_id == "a")
    assert seq.start_pos == 0 and seq.token_ids[:6] == a.prompt_token_ids and seq.num_generated == 3
    sched.resume("c")
    assert sched.get_request("c").state is RequestState.PREEMPTED
    run_to_end(sched)
    assert sched.kv_cache.num_used_blocks == 0


def test_kv_block_seconds_are_charged_to_request_and_tenant(make_sched, clock):
    sched = make_sched(block_size=4)
    sched.add_request(req("a", prompt_len=8, max_tokens=10, tenant="t"))
    step(sched)  # two blocks from t=0
    clock.now = 10.0
    step(sched)  # position 8 needs a third block at t=10
    clock.now = 15.0
    sched.abort("a")
    assert sched.get_request("a").kv_block_seconds == 2 * 10.0 + 3 * 5.0
    assert sched.ledger.usage["t"].kv_block_seconds == 35.0


def test_last_step_reports_the_batch_composition(make_sched):
    sched = make_sched(token_budget=10, max_prefill_chunk=64)
    sched.add_request(req("a", prompt_len=3, max_tokens=5))
    step(sched)
    sched.add_request(req("b", prompt_len=20, max_tokens=5, first=50))
    step(sched)
    assert sched.stats()["last_step"] == {
        "seqs": 2,
        "prefill_tokens": 9,
        "decode_tokens": 1,
        "budget_used": 10.0,
        "token_budget": 10,
    }
