"""`systemctl reload` (SIGHUP) applies the config without dropping a request: streams that
are mid-generation when the signal comes all finish with every token."""

from __future__ import annotations

import signal

import pytest
import trio
from support.daemon import NotifyListener

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import send_command

pytestmark = pytest.mark.timeout(240)  # a hang fails this test instead of the suite

STREAMS = 4
TOKENS = 300


async def test_sighup_with_requests_in_flight_loses_none(sluiced, drained_and_consistent,
                                                         tmp_path) -> None:
    listener = NotifyListener(tmp_path / "notify.sock")
    config = tmp_path / "sluiced.toml"
    config.write_text("[scheduler.tenants.chat]\nweight = 1.0\n")
    process, fields = sluiced(
        ["--executor", "null", "--config", str(config), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock"], env={"NOTIFY_SOCKET": listener.path})
    await listener.wait_for("READY=1")
    results = []

    async def stream(client: AsyncClient, reloaded: trio.Event) -> None:
        generation = await client.generate("x", max_tokens=TOKENS, ignore_eos=True)
        count = 0
        async for chunk in generation:
            count += 1
            if count == 3:
                await reloaded.wait()  # every stream is mid-generation across the reload
        results.append(generation.result)

    with trio.fail_after(120):
        async with AsyncClient(fields["listen"], tenant="chat", credit_window=2) as client:
            reloaded = trio.Event()
            async with trio.open_nursery() as nursery:
                for _ in range(STREAMS):
                    nursery.start_soon(stream, client, reloaded)
                await trio.sleep(0)  # let the streams start
                config.write_text("[scheduler.tenants.chat]\nweight = 3.0\n")
                report = await _wait_running(fields["control"], STREAMS)
                assert report.requests.running + report.requests.paused == STREAMS
                process.send_signal(signal.SIGHUP)
                await listener.wait_for("RELOADING=1")
                await listener.wait_for("READY=1", count=2)
                snap = await send_command(fields["control"], m.Subscribe(ttl=0.5))
                assert snap.detail.tenants["chat"].weight == 3.0  # the reload took
                reloaded.set()
    assert [r.finish_reason for r in results] == ["length"] * STREAMS
    assert [len(r.token_ids) for r in results] == [TOKENS] * STREAMS
    report = await drained_and_consistent(fields["control"])
    assert report.counters.cancelled == 0 and report.counters.finished == STREAMS


async def _wait_running(control: str, count: int):
    from sluice.ipc.control import fetch_status

    while True:
        report = await fetch_status(control)
        if report.requests.running + report.requests.paused >= count:
            return report
        await trio.sleep(0.02)
