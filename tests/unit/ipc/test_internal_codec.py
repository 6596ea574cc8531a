"""Messages between actors cross as bytes and come back equal, with their own types; anything
that is not data (an inbox, a socket, an object with state) is refused at the sender."""

from __future__ import annotations

import dataclasses

import pytest

from sluice.actors.runtime import messages as am
from sluice.actors.runtime import reports
from sluice.actors.runtime.base import Inbox
from sluice.actors.executor import protocol, worker
from sluice.actors.runtime.registry import CODEC
from sluice.actors.scheduler.plan import (RequestOutput, SampledToken, ScheduledSeq, StepOutputs,
                                         StepPlan, StepResult)
from sluice.ipc.vocabulary import SamplingParams
from sluice.ipc import messages as m

SAMPLING = SamplingParams(max_tokens=9, temperature=0.7, top_k=5, seed=3, stop=("END",),
                          stop_token_ids=(2,))
CHUNK = m.Chunk("r1", "héllo", (5, 6), (-0.5, -1.25))
FINISHED = m.Finished("r1", m.FinishReason.LENGTH, m.Usage(3, 2, 1, 0), m.Timings(0.1, 0.2, 0.3))
SNAPSHOT = m.ControlSnapshot(
    2, m.StatusReport("serving", m.WorkerStatus("ready"), m.KVStatus(8, 6, 2, 0),
                      m.RequestCounts(0, 1, 0), m.Counters(1, 0, 0, 0, 0)),
    m.ConsoleDetail(queues={"decoding": 1},
                    tenants={"a": m.TenantRow(2.0, m.TenantLimits(max_running=1), True,
                                              {"decoding": 1}, 0, 1, 0.5, m.TenantTotals(3.0))},
                    requests=(m.RequestRow("ab/1", "a", "decoding", 0.25, 3, 1, 1, False),),
                    latency=m.LatencySummary(m.Percentiles(0.1, 0.2, 0.3))))


def roundtrip(msg):
    return CODEC.decode(CODEC.encode(msg))


@pytest.mark.parametrize("msg", [
    am.Encode(m.Generate("r1", messages=(m.ChatMessage("user", "hi"),),
                        sampling=m.SamplingParams(max_tokens=4, stop=("x",))),
             "abcd/r1", b"\x00\xffconn", "inproc://stream", 12.5),
    am.Admit("abcd/r1", b"conn", (1, 2, 3), SAMPLING, 2, "tenant-a", 1.5),
    am.Release(("a/1", "a/2"), m.FinishReason.TIMEOUT),
    am.AdmissionRefused("a/1", m.RejectCode.TOO_LONG, "prompt too long", "prompt"),
    am.Deliver.of((m.Accepted("r1", 7), CHUNK, CHUNK, FINISHED)),
    am.Deliver.of((CHUNK, CHUNK, CHUNK)),
    am.Outbound(b"conn", (b"frame-1", b"frame-2")),
    am.Ask(m.StatusQuery(check_invariants=True), "inproc://control", 4),
    am.Operate(m.CancelCommand("a/1"), "inproc://control", 5, frozenset({b"a", b"b"})),
    am.Operate(am.ReleaseAll()),
    am.Reply(5, m.CommandReply("cancel", True, "cancelled a/1")),
    am.StepOutputs(StepOutputs(["a/3", "a/4"], [3, 4], [
        RequestOutput(f"a/{i}", [i], finished=i == 2,
                      finish_reason=m.FinishReason.LENGTH if i == 2 else None, prompt_tokens=4)
        for i in range(3)]), (("a/5", 12),)),
    am.StepOutputs(StepOutputs(outputs=[
        RequestOutput("a/1", [7], logprobs=[SampledToken(7, -0.25, [(7, -0.25)])])])),
    reports.Backlog("tokenizer", 48),
    am.Reply(3, reports.WorkerState("ready", reports.WorkerFacts(64, 16, 2048, 49152, "float32"))),
    am.Reply(3, reports.WorkerState("failed", None, "worker exited with 1")),
    reports.Histogram("itl", "a", (0.001, 0.01), (1, 0, 2), 0.125),
    am.Reply(6, reports.MetricsSnapshot(
        SNAPSHOT, (reports.Histogram("ttft", "", (1.0,), (0, 1), 2.0),))),
    am.WorkerLost("worker exited with -9"),
    # the worker protocol, in the same registry
    protocol.Hello(4321, reports.WorkerFacts(64, 16, 2048, 49152, "bfloat16", "float32")),
    protocol.HealthCheck(),
    protocol.HealthAnswer(42, 0.5),
    protocol.WorkerError("RuntimeError: boom"),
])  # fmt: skip
def test_messages_come_back_equal(msg) -> None:
    back = roundtrip(msg)
    assert back == msg
    assert type(back) is type(msg)


def test_enums_lists_tuples_and_sets_keep_their_types() -> None:
    release = roundtrip(am.Release(("a/1",), m.FinishReason.CANCELLED))
    assert release.reason is m.FinishReason.CANCELLED and isinstance(release.request_ids, tuple)
    outputs = roundtrip(am.StepOutputs(StepOutputs(["a/2"], [3], [RequestOutput("a/1", [4, 5])])))
    assert type(outputs.outputs.outputs[0].new_token_ids) is list
    assert type(outputs.outputs.token_ids) is list
    operate = roundtrip(am.Operate("x", "", 0, frozenset({b"c"})))
    assert type(operate.connections) is frozenset
    ended = roundtrip(am.Ended((), (m.RejectCode.INVALID, m.RejectCode.TOO_LONG)))
    assert [type(code) for code in ended.rejected] == [m.RejectCode, m.RejectCode]


def test_a_step_plan_and_its_result_cross_whole() -> None:
    other = dataclasses.replace(SAMPLING, temperature=0.0)
    plan = StepPlan(7, [
        ScheduledSeq("a/1", [1, 2, 3], 0, [4, 9], True, SAMPLING, 0, 11, [1, 2, 3], []),
        ScheduledSeq("a/2", [8], 40, [1, 2, 3], True, other, 5, 12),
        ScheduledSeq("a/3", [6, 6], 3, [0], False, SAMPLING),
    ])  # fmt: skip
    back = roundtrip(plan)
    assert back == plan
    assert back.seqs[0].sampling is back.seqs[2].sampling  # equal params sent once
    result = StepResult(7, {"a/1": 3, "a/2": 9}, 0.004,
                        {"a/1": SampledToken(3, -0.1, [(3, -0.1), (4, -2.0)])})
    assert roundtrip(result) == result
    assert roundtrip(StepResult(7, {"a/2": 9})).logprobs == {}


def test_a_compact_form_read_or_written_by_hand_is_the_objects_own() -> None:
    plan = StepPlan(7, [ScheduledSeq("a/1", [8], 40, [1, 2, 3], True, SAMPLING, 5, 12)],
                    [[0, "regex", "a+"]])
    step_id, samplings, seqs, grammars = CODEC.decode_compact(worker.encode_plan(plan), StepPlan)
    assert step_id == 7 and seqs[0][0] == "a/1" and seqs[0][6] == 5
    assert SamplingParams.from_plain(samplings[0]) == SAMPLING
    assert [list(grammar) for grammar in grammars] == [[0, "regex", "a+"]]
    result = StepResult(7, {"a/1": 3, "a/2": 8}, 0.0, {"a/1": SampledToken(3, -0.1, [(3, -0.1)])},
                        [0])
    by_hand = CODEC.encode_compact(StepResult, [7, ["a/1", "a/2"], [3, 8],
                                                {"a/1": [3, -0.1, [(3, -0.1)]]}, 0.0, [0]])
    assert worker.decode_result(by_hand) == result
    with pytest.raises(TypeError, match="expected a StepPlan, got a StepResult"):
        CODEC.decode_compact(by_hand, StepPlan)
    with pytest.raises(TypeError, match="expected a StepPlan"):
        CODEC.decode_compact(CODEC.encode([1, 2]), StepPlan)


def test_the_receiver_gets_a_copy() -> None:
    tokens = [1, 2]
    out = RequestOutput("a/1", tokens)
    frame = CODEC.encode(am.StepOutputs(StepOutputs(outputs=[out])))
    tokens.append(3)  # the sender keeps using its object
    assert CODEC.decode(frame).outputs.outputs[0].new_token_ids == [1, 2]


def test_objects_that_are_not_data_are_refused_at_the_sender() -> None:
    inbox = Inbox("not-data")
    try:
        with pytest.raises(TypeError, match="Inbox cannot travel between actors"):
            CODEC.encode(am.Ask(m.StatusQuery(), inbox, 1))
        with pytest.raises(TypeError, match="object cannot travel"):
            CODEC.encode(am.Reply(1, object()))
    finally:
        inbox.close()


def test_the_worker_protocol_round_trips_plans_and_results() -> None:
    seq = ScheduledSeq("a/1", [1, 2, 3], 0, [0], True, SAMPLING)
    plan = StepPlan(7, [seq])
    assert worker.decode_plan(worker.encode_plan(plan)) == plan
    result = StepResult(7, {"a/1": 5}, 0.01, {"a/1": SampledToken(5, -0.5, [(5, -0.5)])})
    assert worker.decode_result(worker.encode_result(result)) == result
    with pytest.raises(TypeError, match="StepPlan"):
        worker.decode_plan(worker.encode(protocol.HealthCheck()))


def test_the_worker_side_of_the_registry_loads_no_trio() -> None:
    import subprocess
    import sys

    code = ("import sys, sluice.actors.executor.worker as w; w.encode(w.HealthCheck()); "
            "print(sorted({'trio', 'zmq', 'torch'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
