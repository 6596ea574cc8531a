"""The core loop: budgets, chunked prefill, plan contents, finishing, rejections, invariants."""

from __future__ import annotations

import pytest
from support.scheduler import req, sample_all, step

from sluice.actors.scheduler import Request, RequestState, SchedulerConfig, TenantConfig
from sluice.actors.scheduler.config import ConfigError
from sluice.actors.scheduler.plan import StepResult
from sluice.ipc.vocabulary import (
    FinishReason, InvalidRequestError, OverloadedError, QuotaError, RejectCode, RejectedError,
    SamplingParams, TooLongError,
)


def test_prompt_is_chunked_and_the_last_chunk_samples(make_sched):
    sched = make_sched(max_prefill_chunk=4, block_size=4)
    sched.add_request(req("a", prompt_len=10, max_tokens=2))
    chunks = []
    for _ in range(3):
        plan, outputs = step(sched)
        (seq,) = plan.seqs
        chunks.append((seq.start_pos, len(seq.token_ids), seq.sample, len(seq.block_table)))
    assert chunks == [(0, 4, False, 1), (4, 4, False, 2), (8, 2, True, 3)]
    assert outputs[0].new_token_ids == [7]
    request = sched.get_request("a")
    assert request.state is RequestState.DECODING
    assert request.num_computed_tokens == 10


def test_plan_tokens_follow_the_known_tokens(make_sched):
    sched = make_sched(block_size=4)
    r = req("a", prompt_len=5, max_tokens=3)
    sched.add_request(r)
    plan, _ = step(sched, token=42)
    assert plan.seqs[0].token_ids == r.prompt_token_ids
    plan, _ = step(sched, token=43)
    (seq,) = plan.seqs
    assert (seq.token_ids, seq.start_pos, seq.num_generated, seq.sample) == ([42], 5, 1, True)
    assert len(seq.block_table) == 2  # covers position 5


def test_token_budget_caps_decodes_then_prefill(make_sched):
    sched = make_sched(token_budget=6, max_prefill_chunk=64, max_prefilling=4)
    for i in range(4):
        sched.add_request(req(f"d{i}", prompt_len=1, max_tokens=50, first=10 * i))
    step(sched)  # four one-token prompts: every request is decoding now
    sched.add_request(req("long", prompt_len=100, max_tokens=1))
    plan, _ = step(sched)
    assert plan.decode_tokens == 4
    assert plan.prefill_tokens == 2  # the two units decodes left over
    assert plan.num_tokens <= 6


def test_weighted_budget(make_sched):
    sched = make_sched(token_budget=10, prefill_weight=2.0, decode_weight=1.0, max_prefill_chunk=64)
    sched.add_request(req("a", prompt_len=30, max_tokens=1))
    plan, _ = step(sched)
    assert plan.prefill_tokens == 5  # 5 tokens * w_p 2 = 10


def test_prefill_first_keeps_the_decode_share(make_sched):
    sched = make_sched(
        order="prefill_first", token_budget=8, decode_share=0.5, max_prefill_chunk=64
    )
    for i in range(6):
        sched.add_request(req(f"d{i}", prompt_len=1, max_tokens=50, first=10 * i))
    step(sched)
    sched.add_request(req("long", prompt_len=100, max_tokens=1))
    plan, _ = step(sched)
    assert plan.decode_tokens == 4 and plan.prefill_tokens == 4


def test_max_prefilling_and_max_running(make_sched):
    sched = make_sched(max_prefilling=2, max_running=3, max_prefill_chunk=2, token_budget=100)
    for i in range(5):
        sched.add_request(req(f"r{i}", prompt_len=6, max_tokens=10, first=10 * i))
    plan, _ = step(sched)
    assert sorted(s.request_id for s in plan.seqs) == ["r0", "r1"]
    for _ in range(3):
        step(sched)
    stats = sched.stats()
    assert stats["queues"]["decoding"] + stats["queues"]["prefilling"] == 3
    assert stats["queues"]["waiting"] == 2


def test_fcfs_admits_in_arrival_order(make_sched, clock):
    sched = make_sched(max_prefilling=1, max_prefill_chunk=64)
    for rid, t in (("late", 5.0), ("early", 1.0), ("mid", 3.0)):
        sched.add_request(req(rid, prompt_len=4, max_tokens=1, arrival=t))
    order = [step(sched)[0].seqs[0].request_id for _ in range(3)]
    assert order == ["early", "mid", "late"]


@pytest.mark.parametrize(
    "sampling,token,reason,count",
    [
        (dict(max_tokens=3), 7, FinishReason.LENGTH, 3),
        (dict(max_tokens=9, stop_token_ids=(7,)), 7, FinishReason.STOP, 1),
        (dict(max_tokens=9), 2, FinishReason.STOP, 1),  # 2 is EOS
        (dict(max_tokens=9, ignore_eos=True), 2, FinishReason.LENGTH, 9),
    ],
)
def test_finish_reasons_release_blocks(make_sched, sampling, token, reason, count):
    sched = make_sched(block_size=4, eos_token_ids=frozenset({2}))
    sched.add_request(Request("a", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, **sampling)))
    produced = []
    for _ in range(20):
        _, outputs = step(sched, token=token)
        produced += [t for o in outputs for t in o.new_token_ids]
        if outputs and outputs[-1].finished:
            break
    final = outputs[-1]
    assert (final.finish_reason, final.prompt_tokens, len(produced)) == (reason, 5, count)
    assert sched.kv_cache.num_used_blocks == 0
    assert not sched.has_unfinished()
    assert sched.get_request("a").state is RequestState.FINISHED


def test_max_model_len_ends_with_length(make_sched):
    sched = make_sched(max_model_len=8)
    sched.add_request(req("a", prompt_len=6, max_tokens=100))
    outputs = []
    while sched.has_unfinished():
        outputs += step(sched)[1]
    assert len(outputs) == 2 and outputs[-1].finish_reason is FinishReason.LENGTH


def test_abort_frees_blocks_immediately_and_reports_usage(make_sched):
    sched = make_sched(block_size=4)
    sched.add_request(req("a", prompt_len=9, max_tokens=10))
    step(sched)
    assert sched.kv_cache.num_used_blocks == 3
    out = sched.abort("a")
    assert out.finished and out.finish_reason is FinishReason.CANCELLED and out.prompt_tokens == 9
    assert sched.kv_cache.num_used_blocks == 0
    assert sched.abort("a") is None and sched.abort("nope") is None
    sched.check_invariants()


def test_finish_from_the_engine_ends_with_stop(make_sched):
    sched = make_sched()
    sched.add_request(req("a", max_tokens=10))
    step(sched)
    out = sched.finish("a")
    assert out.finish_reason is FinishReason.STOP and sched.get_request("a").state is RequestState.FINISHED
    assert sched.kv_cache.num_used_blocks == 0


def test_result_for_an_aborted_request_is_ignored(make_sched):
    sched = make_sched()
    sched.add_request(req("a"))
    sched.add_request(req("b", first=50))
    plan = sched.schedule()
    sched.abort("a")
    outputs = sched.update(plan, sample_all(plan))
    assert [o.request_id for o in outputs] == ["b"]
    sched.check_invariants()


def test_missing_sample_fails_only_that_request(make_sched):
    sched = make_sched()
    sched.add_request(req("a"))
    sched.add_request(req("b", first=50))
    plan = sched.schedule()
    outputs = sched.update(plan, StepResult(plan.step_id, {"b": 3}))
    by_id = {o.request_id: o for o in outputs}
    assert by_id["a"].finish_reason is FinishReason.ERROR and by_id["b"].new_token_ids == [3]
    sched.check_invariants()


def test_seeds_and_penalty_fields(make_sched):
    sched = make_sched()
    sched.add_request(req("seeded", seed=1234))
    sched.add_request(req("free", first=50))
    sched.add_request(req("pen", first=90, repetition_penalty=1.2))
    plan, _ = step(sched)
    seqs = {s.request_id: s for s in plan.seqs}
    assert seqs["seeded"].sampling_seed == 1234
    assert 0 <= seqs["free"].sampling_seed < 2**63
    assert seqs["free"].prompt_token_ids is None
    assert seqs["pen"].prompt_token_ids == list(range(90, 98))
    plan, _ = step(sched)
    seqs2 = {s.request_id: s for s in plan.seqs}
    assert seqs2["free"].sampling_seed == seqs["free"].sampling_seed
    assert seqs2["pen"].output_token_ids == [7]


@pytest.mark.parametrize(
    "make_request,error,field",
    [
        (lambda: Request("a", [], SamplingParams()), InvalidRequestError, "prompt_token_ids"),
        (lambda: Request("", [1], SamplingParams()), InvalidRequestError, "request_id"),
        (lambda: Request("a", list(range(64)), SamplingParams()), TooLongError, "prompt_token_ids"),
        (lambda: req("a", tenant="t", max_tokens=100), QuotaError, "max_tokens"),
        (lambda: req("a", tenant="t", prompt_len=30, max_tokens=30), QuotaError,
         "prompt_token_ids"),
    ],
)
def test_rejections_are_typed_and_name_the_field(make_sched, make_request, error, field):
    sched = make_sched(
        max_model_len=64, tenants={"t": TenantConfig(max_new_tokens=50, max_context=40)}
    )
    with pytest.raises(error) as info:
        sched.add_request(make_request())
    assert isinstance(info.value, RejectedError)
    assert info.value.field == field and field in info.value.message
    assert info.value.code in (RejectCode.INVALID, RejectCode.TOO_LONG, RejectCode.QUOTA)
    sched.add_request(req("ok"))  # keeps serving
    assert sched.has_unfinished()


def test_duplicate_id_queue_limits(make_sched):
    sched = make_sched(max_queued=2, tenants={"t": TenantConfig(max_queued=1)})
    sched.add_request(req("a"))
    with pytest.raises(InvalidRequestError, match="request_id"):
        sched.add_request(req("a"))
    sched.add_request(req("t1", tenant="t"))
    with pytest.raises(QuotaError, match="max_queued"):
        sched.add_request(req("t2", tenant="t"))
    with pytest.raises(OverloadedError):
        sched.add_request(req("b"))
    assert sched.stats()["rejected"] == 3


def test_a_tenant_allowed_no_queue_is_refused_from_its_first_request(make_sched):
    sched = make_sched(tenants={"closed": TenantConfig(max_queued=0, max_running=0)})
    with pytest.raises(QuotaError, match="max_queued 0"):
        sched.add_request(req("c1", tenant="closed"))
    assert not sched.has_unfinished()


def test_prompt_larger_than_the_kv_pool_is_too_long(make_sched):
    sched = make_sched(kv_blocks=2, block_size=4)
    with pytest.raises(TooLongError, match="KV pool"):
        sched.add_request(req("a", prompt_len=8))


def test_config_from_dict_rejects_unknown_keys():
    config = SchedulerConfig.from_dict(
        {"policy": "srpt", "token_budget": 4, "tenants": [{"name": "a", "weight": 2.0}]}
    )
    assert config.tenant("a").weight == 2.0 and config.tenant("other").weight == 1.0
    with pytest.raises(ConfigError, match="tokne_budget"):
        SchedulerConfig.from_dict({"tokne_budget": 4})
    with pytest.raises(ConfigError, match="policy"):
        SchedulerConfig.from_dict({"policy": "lottery"})
    with pytest.raises(ConfigError, match="tenants.a.weight"):
        SchedulerConfig.from_dict({"tenants": {"a": {"weight": -1}}})


def test_invariant_check_catches_a_leak(make_sched):
    sched = make_sched()
    sched.add_request(req("a"))
    step(sched)
    sched.get_request("a").block_ids.pop()
    with pytest.raises(AssertionError, match="holds"):
        sched.check_invariants()


def test_request_that_cannot_finish_alone_in_the_pool_is_too_long(make_sched):
    sched = make_sched(kv_blocks=4, block_size=4)
    with pytest.raises(TooLongError, match="max_tokens"):
        sched.add_request(req("a", prompt_len=8, max_tokens=9))
    sched.add_request(req("b", prompt_len=8, max_tokens=8))


def test_decodes_beyond_the_budget_take_turns(make_sched):
    sched = make_sched(token_budget=2, max_prefill_chunk=1, max_prefilling=4, order="prefill_first")
    for i in range(4):
        sched.add_request(req(f"r{i}", prompt_len=1, max_tokens=50, first=10 * i))
    for _ in range(2):
        step(sched)
    assert sched.stats()["queues"]["decoding"] == 4
    counts = {f"r{i}": 0 for i in range(4)}
    for _ in range(8):
        plan, _ = step(sched)
        for seq in plan.seqs:
            counts[seq.request_id] += 1
    assert counts == {"r0": 4, "r1": 4, "r2": 4, "r3": 4}
