"""Operator commands, reconcile and status as plain functions over the scheduler core: each
returns its reply and the requests it ended, and leaves the core consistent. No trio here."""

from __future__ import annotations

from sluice.actors.scheduler import commands
from sluice.actors.scheduler import Request, Scheduler, SchedulerConfig, TenantConfig
from sluice.actors.scheduler.latency import LatencyLog
from sluice.actors.scheduler.plan import StepResult
from sluice.ipc.vocabulary import SamplingParams
from sluice.ipc import messages as m
from sluice.ipc.codec import Codec
from sluice.ipc.vocabulary import FinishReason

WORKER = m.WorkerStatus("ready", 2, 1234)
CONNECTION = b"\x01\x02"


def _core(**settings) -> Scheduler:
    return Scheduler(SchedulerConfig(kv_blocks=32, block_size=4, **settings), max_model_len=256)


def _running(core: Scheduler, *rids: str) -> None:
    for i, rid in enumerate(rids):
        core.add_request(Request(rid, list(range(10 * i + 1, 10 * i + 7)),
                                 SamplingParams(max_tokens=50, temperature=0.0)))
    plan = core.schedule()
    core.update(plan, StepResult(plan.step_id, {s.request_id: 3
                                                for s in plan.seqs if s.sample}))


def test_cancel_ends_a_live_request_and_frees_its_blocks() -> None:
    core = _core()
    _running(core, "a")
    reply, outputs = commands.cancel(core, "a")
    assert reply.ok and reply.message == "cancelled a"
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", FinishReason.CANCELLED)]
    assert core.kv_cache.num_used_blocks == 0
    reply, outputs = commands.cancel(core, "a")
    assert not reply.ok and outputs == [] and "no live request a" in reply.message
    core.check_invariants()


def test_release_all_cancels_everyone() -> None:
    core = _core()
    _running(core, "a", "b")
    reply, outputs = commands.release_all(core)
    assert reply.ok and "cancelled 2 requests" in reply.message
    assert sorted(o.request_id for o in outputs) == ["a", "b"]
    assert not core.has_unfinished() and core.kv_cache.num_used_blocks == 0


def test_set_tenant_changes_only_the_fields_named_and_refuses_bad_values() -> None:
    core = _core(tenants={"t": TenantConfig(weight=2.0, max_running=3)})
    reply, outputs = commands.set_tenant(core, m.TenantSet("t", max_queued=5))
    assert reply.ok and outputs == []
    assert core.config.tenant("t") == TenantConfig(weight=2.0, max_running=3, max_queued=5)
    reply, _ = commands.set_tenant(core, m.TenantSet("t", weight=-1.0))
    assert not reply.ok and "weight" in reply.message
    assert core.config.tenant("t").weight == 2.0
    assert commands.set_tenant(core, m.TenantSet("t", reset=True))[0].ok
    assert core.config.tenant("t") == TenantConfig()


def test_reconcile_frees_a_leaked_block_and_requests_of_gone_connections() -> None:
    core = _core()
    live, gone = CONNECTION.hex(), b"\x09\x09".hex()
    _running(core, f"{live}/1", f"{gone}/1", "inproc-id")
    assert commands.leak_block(core).ok
    assert [extra for _, extra in commands.unowned_references(core)] == [1]
    findings, outputs = commands.reconcile(core, frozenset({CONNECTION}))
    assert [o.request_id for o in outputs] == [f"{gone}/1"]
    assert len(findings) == 2 and "no live connection" in findings[0] and "freed" in findings[1]
    assert set(core.requests) == {f"{live}/1", "inproc-id"}  # ids without a connection stay
    assert commands.unowned_references(core) == []
    core.check_invariants()
    assert commands.reconcile(core, frozenset({CONNECTION})) == ([], [])
    assert commands.reconcile_reply([]).message == "consistent: nothing to fix"
    assert commands.reconcile_reply(findings).findings == tuple(findings)


def test_status_report_counts_requests_and_reports_a_broken_invariant() -> None:
    core = _core()
    _running(core, "a", "b")
    core.pause("b")
    counters = {"accepted": 2, "finished": 0, "cancelled": 0, "rejected": 0}
    report = commands.status_report(core, worker=WORKER, counters=counters, draining=True,
                                    check=True)
    assert report.state == "draining" and report.worker == WORKER
    assert (report.requests.waiting, report.requests.running, report.requests.paused) == (0, 1, 1)
    assert report.kv.used_blocks == core.kv_cache.num_used_blocks > 0
    assert report.invariant_errors == () and report.counters.accepted == 2
    core.kv_cache.allocate(1)  # a block nobody owns
    broken = commands.status_report(core, worker=WORKER, counters=counters, draining=False,
                                    check=True)
    assert broken.state == "serving" and "owned by no live request" in broken.invariant_errors[0]


def test_console_detail_is_typed_and_crosses_the_control_codec_unchanged() -> None:
    # a weight and a budget as a config file may write them: whole numbers where the record
    # says float must still decode on the console's side
    core = _core(token_budget=64, tenants={"chat": TenantConfig(weight=2, max_running=4)})
    _running(core, "a", "b")
    core.pause("b")
    core.add_request(Request("c", [1, 2, 3], SamplingParams(max_tokens=2), tenant="chat"))
    core.abort("a", FinishReason.CANCELLED)
    latency = commands.latency_summary({"ttft": {"p50": 0.04, "p95": 0.05, "p99": 0.06},
                                        "itl": {"p50": 0.01, "p95": 0.02, "p99": 0.03},
                                        "tokens_per_second": 120.0, "output_tokens": 9})
    detail = commands.console_detail(core, latency=latency)
    assert [(r.request_id, r.tenant, r.state, r.blocks, r.paused) for r in detail.requests] == [
        ("b", "default", "paused", 2, True), ("c", "chat", "waiting", 0, False)]
    assert detail.queues == {"waiting": 1, "prefilling": 0, "decoding": 0, "paused": 1,
                             "preempted": 0}
    assert detail.ended == {"cancelled": 1} and detail.policy == "fair" and detail.step == 1
    assert detail.last_step == m.PlanComposition(2, 12, 0, 12.0, 64)
    assert detail.kv.block_size == 4 and detail.kv.high_watermark == 0.95
    chat = detail.tenants["chat"]
    assert (chat.weight, chat.limits.max_running, chat.configured) == (2, 4, True)
    assert chat.queues == {"waiting": 1} and detail.tenants["default"].totals.prefill_tokens == 12
    assert detail.latency.ttft.p99 == 0.06 and detail.latency.output_tokens == 9
    assert commands.latency_summary(LatencyLog().summary(0.0)) == m.LatencySummary()

    snapshot = m.ControlSnapshot(7, commands.status_report(core, worker=WORKER, counters={},
                                                           draining=False), detail)
    codec = Codec(m.CONTROL_REPLIES)
    assert codec.decode(codec.encode(snapshot)) == snapshot
