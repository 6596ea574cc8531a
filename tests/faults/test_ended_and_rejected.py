"""What docs/operations.md promises about ended and refused requests: `/metrics` counts them by
reason and by code — refused by a Stream or already at the gateway (a frame that does not
decode) — and a client that vanished mid-request still gets a usage record."""

from __future__ import annotations

import json

import pytest
import trio

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status
from sluice.ipc.vocabulary import InvalidRequestError, TooLongError

from support.daemon import http_get, samples
from support.raw_peer import RawPeer


async def test_ended_and_rejected_counters_and_a_vanished_clients_usage_record(
    null_daemon, tmp_path
) -> None:
    path = tmp_path / "usage.jsonl"
    handle = await null_daemon(metrics_port=0, **{"usage.path": str(path),
                                                  "null.max_model_len": 64,
                                                  "stream.heartbeat_interval": 0.2,
                                                  "stream.heartbeat_timeout": 1.0})
    with trio.fail_after(60):
        async with AsyncClient(handle.listen) as client:
            for i in range(2):
                assert (await (await client.generate(f"p{i}", max_tokens=3)).collect()) \
                    .finish_reason == "length"
            cancelled = await client.generate("to cancel", max_tokens=30000, ignore_eos=True)
            await cancelled.cancel()
            with pytest.raises(InvalidRequestError) as invalid:  # over limits.max_stop_strings
                await client.generate("hi", stop=[f"s{i}" for i in range(17)])
            assert invalid.value.field == "sampling.stop"
            with pytest.raises(TooLongError):  # over the model's context
                await client.generate(prompt_ids=[5] * 100)
            with RawPeer(handle.listen) as garbler:  # refused by the gateway, not a Stream
                await garbler.socket.send(b"\x92\x00not a message")
                refused = await garbler.receive()
                assert isinstance(refused, m.Rejected) and refused.code == m.RejectCode.INVALID
            # a client that vanishes with a request running: no Cancel, it just stops
            with RawPeer(handle.listen) as ghost:
                await ghost.send(m.Generate("ghost", prompt="hi", credits=1,
                                            sampling=m.SamplingParams(max_tokens=30000,
                                                                      ignore_eos=True)))
                assert isinstance(await ghost.receive(), m.Accepted)
            while (await fetch_status(handle.control)).counters.cancelled < 2:
                await trio.sleep(0.05)  # its heartbeat timeout ends it
        records = await _records(path, 4)  # two served, two cancelled; none refused
        ghost_record = next(r for r in records if r["client_request_id"] == "ghost")
        assert ghost_record["finish_reason"] == "cancelled"
        status, text = await http_get(handle.daemon.metrics_port, "/metrics")
    assert status == 200
    values = samples(text)
    assert values[("sluice_requests_ended_total", (("reason", "length"),))] == 2
    assert values[("sluice_requests_ended_total", (("reason", "cancelled"),))] == 2
    assert values[("sluice_requests_rejected_total", (("code", "invalid"),))] == 2
    assert values[("sluice_requests_rejected_total", (("code", "too_long"),))] == 1


async def _records(path, count: int) -> list[dict]:
    while not path.exists() or len(path.read_text().splitlines()) < count:
        await trio.sleep(0.02)
    return [json.loads(line) for line in path.read_text().splitlines()]
