"""The wire codec: round trips, and every kind of bad frame becomes a CodecError naming it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.ipc import messages as m
from sluice.ipc.codec import Codec, CodecError, to_plain

client_codec = Codec(m.CLIENT_MESSAGES)


def frame(tag: int, body: object, major: int = m.PROTOCOL_MAJOR,
          minor: int = m.PROTOCOL_MINOR) -> bytes:
    return msgpack.packb([major, minor, tag, body], use_bin_type=True)


STATUS = m.StatusReport("serving", m.WorkerStatus("ready", 1), m.KVStatus(10, 8, 2, 0),
                        m.RequestCounts(1, 2, 0), m.Counters(5, 4, 1, 0, 0))
# every field of the console's detail away from its default
FULL_DETAIL = m.ConsoleDetail(
    step=41, policy="fair", queues={"waiting": 1, "decoding": 2, "paused": 1},
    kv=m.KVDetail(0.25, 0.9, 0.8, False, 16, 0.5),
    last_step=m.PlanComposition(3, 40, 2, 42.0, 512.0),
    rejected=2, ended={"stop": 3, "cancelled": 1},
    tenants={"chat": m.TenantRow(2.0, m.TenantLimits(max_running=4, max_queued=8,
                                                     max_context=2048, max_new_tokens=256), True,
                                 {"decoding": 2}, 1, 2, 7.5,
                                 m.TenantTotals(60.0, 40, 20, 5, 8, 1, 3.25, 3, 1))},
    other_tenants=m.TenantTotals(finished=9, prefill_tokens=90),
    requests=(m.RequestRow("0a0b/1", "chat", "paused", 1.5, 100, 7, 3, True),),
    latency=m.LatencySummary(m.Percentiles(0.04, 0.05, 0.06), m.Percentiles(0.01, 0.02, 0.03),
                             120.0, 9),
)


def decode_error(raw: bytes, codec: Codec = client_codec) -> CodecError:
    with pytest.raises(CodecError) as info:
        codec.decode(raw)
    return info.value


@pytest.mark.parametrize(
    "msg",
    [
        m.Generate("r1", prompt="hello", sampling=m.SamplingParams(max_tokens=3, stop=("\n",))),
        m.Generate("r2", messages=(m.ChatMessage("user", "hi ☃"),), priority=-2, tenant="b"),
        m.Generate("r3", prompt_ids=(1, 2, 3), sampling=m.SamplingParams(seed=7, top_k=5)),
        m.Credit("r1", 4),
        m.Cancel("r1"),
        m.Heartbeat(9),
        m.Describe(),
        m.Accepted("r1", 12),
        m.Rejected("r1", m.RejectCode.TOO_LONG, "too long", "prompt"),
        m.Chunk("r1", "héllo", (5, 6), (m.TokenLogprobs("hé", -0.5, (m.TopLogprob(5, "hé", -0.5),
                                                                 m.TopLogprob(9, "ha", -1.5))),
                                          m.TokenLogprobs("llo", -1.0))),
        m.Finished("r1", m.FinishReason.TIMEOUT, m.Usage(3, 4, 1, 0),
                   m.Timings(0.01, 0.02, 0.03, 0.1, 0.2, 0.3, 0.01, 0.07, 0.2, 0.05, 0.3)),
        m.Error("r1", "boom"),
        m.ServerInfo("1.0", "smollm2", 2048),
        m.StatusQuery(True),
        m.StatusReport(
            "serving",
            m.WorkerStatus("ready", 1),
            m.KVStatus(10, 8, 2, 0),
            m.RequestCounts(1, 2, 0),
            m.Counters(5, 4, 1, 0, 0),
            invariant_errors=("leak",),
        ),
        m.ControlSnapshot(3, STATUS, FULL_DETAIL),
        m.ControlSnapshot(4, STATUS),
    ],
)
def test_every_message_round_trips(msg: object) -> None:
    codec = Codec()
    assert codec.decode(codec.encode(msg)) == msg


def test_enums_decode_to_their_types() -> None:
    codec = Codec()
    out = codec.decode(codec.encode(m.Finished("x", m.FinishReason.LENGTH)))
    assert out.reason is m.FinishReason.LENGTH


def test_nested_field_errors_are_dotted() -> None:
    err = decode_error(frame(1, {"request_id": "a", "sampling": {"top_p": "high"}}))
    assert (err.field, err.request_id) == ("sampling.top_p", "a")
    err = decode_error(frame(1, {"request_id": "a", "messages": [{"role": "user"}]}))
    assert err.field == "messages[0].content"
    assert "missing" in err.message


def test_missing_unknown_and_mistyped_fields_are_named() -> None:
    assert decode_error(frame(2, {"chunks": 3})).field == "request_id"
    assert decode_error(frame(2, {"request_id": "a", "chunks": 1, "x": 1})).field == "x"
    assert decode_error(frame(2, {"request_id": "a", "chunks": True})).field == "chunks"
    assert decode_error(frame(1, {"request_id": "a", "prompt_ids": [1, "2"]})).field == (
        "prompt_ids[1]"
    )


def test_the_console_detail_is_checked_down_to_map_entries() -> None:
    control = Codec(m.CONTROL_REPLIES)

    def snapshot_error(**detail: object) -> CodecError:
        body = control.envelope(m.ControlSnapshot(1, STATUS, FULL_DETAIL))[3]
        body["detail"].update(detail)
        return decode_error(frame(m.ControlSnapshot.TAG, body), control)

    assert snapshot_error(queues={"waiting": 1.5}).field == "detail.queues['waiting']"
    assert snapshot_error(queues=[1]).field == "detail.queues"
    bad_row = {"chat": {"totals": {"finished": "3"}}}
    assert snapshot_error(tenants=bad_row).field == "detail.tenants['chat'].totals.finished"
    assert snapshot_error(requests=[{"request_id": "x"}]).field.startswith("detail.requests[0].")
    assert snapshot_error(kv={"block_size": 1.0}).field == "detail.kv.block_size"


@dataclass(frozen=True)
class Loose:
    anything: Any


@dataclass(frozen=True)
class HoldsLoose:
    TAG: ClassVar[int] = 99
    inner: Loose


def test_a_field_the_codec_cannot_check_is_refused_when_the_codec_is_built() -> None:
    with pytest.raises(TypeError, match="unsupported field type"):
        Codec([HoldsLoose])


def test_wrong_major_version_is_its_own_code() -> None:
    err = decode_error(frame(3, {"request_id": "a"}, major=m.PROTOCOL_MAJOR + 1))
    assert err.code is m.RejectCode.PROTOCOL_VERSION
    assert err.request_id == "a"


def test_a_newer_minor_version_may_add_fields_an_older_reader_ignores() -> None:
    server = Codec(m.SERVER_MESSAGES)
    body = {"protocol_version": "2.9", "model": "m", "max_credits": 8, "added_later": [1]}
    info = server.decode(frame(m.ServerInfo.TAG, body, minor=m.PROTOCOL_MINOR + 1))
    assert (info.model, info.max_credits) == ("m", 8)
    same_minor = decode_error(frame(m.ServerInfo.TAG, body), server)
    assert same_minor.field == "added_later"  # a peer of this version misspelt a field
    newer = frame(m.ServerInfo.TAG, {**body, "max_credits": "8"}, minor=m.PROTOCOL_MINOR + 1)
    assert decode_error(newer, server).field == "max_credits"  # known fields are still checked
    missing = frame(m.ServerInfo.TAG, {"model": "m"}, minor=m.PROTOCOL_MINOR + 1)
    assert decode_error(missing, server).field == "protocol_version"


def test_receiver_refuses_tags_it_does_not_accept() -> None:
    codec = Codec()
    err = decode_error(codec.encode(m.Accepted("a", 1)))  # a server message sent to a server
    assert err.field == "tag"


def test_oversize_frame_is_refused_before_parsing() -> None:
    small = Codec(m.CLIENT_MESSAGES, max_frame_bytes=64)
    err = decode_error(small.encode(m.Generate("a", prompt="x" * 100)), small)
    assert err.field == "frame" and "exceeds" in err.message


def test_an_array_past_max_items_is_refused_at_its_header_naming_request_and_field() -> None:
    codec = Codec(m.CLIENT_MESSAGES, max_items=100)
    frame = codec.encode(m.Generate("r1", prompt_ids=tuple(range(101))))
    with pytest.raises(CodecError) as refused:
        codec.decode(frame)
    assert (refused.value.request_id, refused.value.field, refused.value.code) == (
        "r1", "prompt_ids", m.RejectCode.TOO_LONG)
    assert refused.value.message == "101 items exceed limits.max_frame_items = 100"
    stops = m.Generate("r2", prompt="hi", sampling=m.SamplingParams(stop=("x",) * 101))
    with pytest.raises(CodecError) as refused:  # nested: the top-level field is named
        codec.decode(codec.encode(stops))
    assert (refused.value.request_id, refused.value.field, refused.value.code) == (
        "r2", "sampling", m.RejectCode.INVALID)
    assert codec.decode(codec.encode(m.Generate("r3", prompt_ids=tuple(range(100))))) \
        .prompt_ids == tuple(range(100))  # at the limit: taken


def test_json_shape_uses_names_for_enums() -> None:
    plain = to_plain(m.Finished("a", m.FinishReason.STOP))
    assert plain["reason"] == "stop" and plain["usage"]["prompt_tokens"] == 0


def test_json_shape_walks_into_maps() -> None:
    plain = to_plain(FULL_DETAIL)
    assert plain["tenants"]["chat"]["limits"]["max_running"] == 4
    assert plain["requests"][0]["paused"] is True and plain["queues"]["decoding"] == 2


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text() | st.binary(),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
field_names = st.sampled_from(
    ["request_id", "prompt", "messages", "prompt_ids", "sampling", "priority", "tenant",
     "credits", "chunks", "nonce", "bogus"]
)  # fmt: skip


@settings(max_examples=600, deadline=None)
@given(raw=st.binary(max_size=256))
def test_random_bytes_never_escape_as_other_errors(raw: bytes) -> None:
    try:
        client_codec.decode(raw)
    except CodecError as exc:
        assert exc.message
    # bytes that happen to be a valid frame are fine too


@settings(max_examples=600, deadline=None)
@given(
    major=st.sampled_from([m.PROTOCOL_MAJOR, m.PROTOCOL_MAJOR, 0, 2, "1"]),
    tag=st.one_of(st.integers(-2, 40), st.text(max_size=3)),
    body=st.one_of(st.dictionaries(field_names, msgpack_values, max_size=6), msgpack_values),
)
def test_structured_garbage_is_rejected_with_a_field(major: object, tag: object, body: object) -> None:
    raw = msgpack.packb([major, 0, tag, body], use_bin_type=True)
    try:
        msg = client_codec.decode(raw)
    except CodecError as exc:
        assert exc.field, exc
        if major != m.PROTOCOL_MAJOR:
            assert exc.code is m.RejectCode.PROTOCOL_VERSION
    else:
        assert type(msg) in m.CLIENT_MESSAGES


def test_batches_keep_order_and_single_frames_still_decode() -> None:
    codec = Codec()
    msgs = [m.Chunk("a", "x", (1,)), m.Heartbeat(), m.Finished("a", m.FinishReason.STOP)]
    assert codec.decode_batch(codec.encode_batch(msgs)) == msgs
    assert codec.decode_batch(codec.encode(msgs[0])) == msgs[:1]
    with pytest.raises(CodecError):
        codec.decode_batch(msgpack.packb([[1, 0, 18, {}], "junk"]))


def test_a_batch_of_chunks_encodes_as_each_chunk_alone_does() -> None:
    codec = Codec()
    logprobs = (m.TokenLogprobs("x", -0.5, (m.TopLogprob(1, "x", -0.5),)),)
    chunks = [m.Chunk("a", "x", (1,)), m.Chunk("b", "", ()), m.Chunk("a", "x", (1,), logprobs),
              codec.decode(codec.encode(m.Chunk("c", "yz", (2, 3))))]
    frame = codec.encode_batch(chunks)
    assert msgpack.unpackb(frame) == [msgpack.unpackb(codec.encode(c)) for c in chunks]
    assert codec.decode_batch(frame) == chunks
