"""The daemon as systemd sees it: sd_notify over a real unix datagram socket, SIGTERM drains
(running requests finish, new ones are rejected) and exits 0, SIGHUP reloads tenants."""

from __future__ import annotations

import signal

import pytest
import trio

from support.daemon import NotifyListener, assert_consistent
from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import send_command
from sluice.ipc.vocabulary import SluiceError

pytestmark = pytest.mark.timeout(240)  # a hang fails this test instead of the suite


async def test_ready_watchdog_and_sigterm_drain_with_exit_zero(sluiced, tmp_path) -> None:
    listener = NotifyListener(tmp_path / "notify.sock")
    process, fields = sluiced(
        ["--executor", "null", "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{tmp_path}/control.sock", "--drain-deadline", "20"],
        env={"NOTIFY_SOCKET": listener.path, "WATCHDOG_USEC": "100000"})
    await listener.wait_for("READY=1")
    assert any(line.startswith("STATUS=") for line in listener.drain())
    await listener.wait_for("WATCHDOG=1", count=3)
    assert "STOPPING=1" not in listener.drain()

    with trio.fail_after(60):
        async with AsyncClient(fields["listen"], credit_window=2) as client:
            running = await client.generate("x", max_tokens=200, temperature=0)
            texts = []
            async for chunk in running:
                texts.append(chunk.text)
                if len(texts) == 5:
                    # the KV invariant holds mid-request; the daemon exits once drained
                    await assert_consistent(fields["control"])
                    process.send_signal(signal.SIGTERM)
                    await listener.wait_for("STOPPING=1")
                    try:
                        await client.generate("y", max_tokens=2)
                    except SluiceError as exc:
                        assert "draining" in str(exc)
                    else:
                        raise AssertionError("a draining daemon accepted a request")
                await trio.sleep(0.002)
            assert running.result.finish_reason == "length"
            assert len(running.result.token_ids) == 200
    with trio.fail_after(30):
        while process.poll() is None:
            await trio.sleep(0.05)
    assert process.returncode == 0


async def test_sighup_reloads_tenant_limits(sluiced, drained_and_consistent, tmp_path) -> None:
    listener = NotifyListener(tmp_path / "notify.sock")
    config = tmp_path / "sluiced.toml"
    closed = "max_queued = 0\nmax_running = 0\n"
    config.write_text("[scheduler.tenants.batch]\nweight = 1.0\n"
                      f"[scheduler.tenants.opened]\n{closed}[scheduler.tenants.gone]\n{closed}")
    control = f"ipc://{tmp_path}/control.sock"
    process, fields = sluiced(
        ["--executor", "null", "--config", str(config), "--listen", "tcp://127.0.0.1:0",
         "--control", control], env={"NOTIFY_SOCKET": listener.path})
    await listener.wait_for("READY=1")

    async def refused(tenant: str) -> bool:
        async with AsyncClient(fields["listen"], tenant=tenant) as client:
            try:
                result = await (await client.generate("x", max_tokens=2)).collect()
            except SluiceError as exc:
                assert "quota" in str(exc) or "tenant" in str(exc)
                return True
            assert result.finish_reason == "length"
            return False

    with trio.fail_after(20):
        assert [await refused(t) for t in ("batch", "opened", "gone")] == [False, True, True]
    # batch gets limits, opened loses its limits, gone is no longer in the file
    config.write_text(f"[scheduler.tenants.batch]\nweight = 3.0\n{closed}"
                      "[scheduler.tenants.opened]\nweight = 2.0\n")
    process.send_signal(signal.SIGHUP)
    await listener.wait_for("RELOADING=1")
    await listener.wait_for("READY=1", count=2)
    snap = await send_command(control, m.Subscribe(ttl=0.5))
    assert snap.detail.tenants["batch"].weight == 3.0
    assert snap.detail.tenants["opened"].weight == 2.0
    with trio.fail_after(20):
        assert [await refused(t) for t in ("batch", "opened", "gone")] == [True, False, False]
    await drained_and_consistent(control)
    process.send_signal(signal.SIGTERM)
    with trio.fail_after(30):
        while process.poll() is None:
            await trio.sleep(0.05)
    assert process.returncode == 0
