"""The console against a real daemon: the numbers on screen are the snapshot's, and every
command it offers (drain, resume, cancel, reconcile, recover) works behind its confirmation."""

from __future__ import annotations

import pytest
from support.console import drive, start_console_daemon, wait_until
from support.daemon import assert_drained_and_consistent_sync

from sluice.ipc import messages as m
from sluice.ipc.client import Client
from sluice.ipc.control import fetch_status_sync, send_command_sync
from sluice.ipc.vocabulary import SluiceError
from sluice.tui.app import SluiceTop
from sluice.tui.confirm_screen import ConfirmScreen
from sluice.tui.help_screen import HelpScreen
from sluice.tui.report_screen import ReportScreen

pytestmark = pytest.mark.timeout(240)  # a hang fails this test instead of the suite


def _panel_text(app, selector: str) -> str:
    return app.query_one(selector).plain


def test_numbers_on_screen_match_the_snapshot_and_cancel_ends_the_request(console_daemon):
    listen, control = console_daemon
    with Client(listen, credit_window=1, tenant="alpha") as client:
        held = client.generate("hold", max_tokens=3000)

        async def body():
            app = SluiceTop(control)
            async with app.run_test(size=(140, 48)) as pilot:
                await wait_until(pilot, lambda: app.snapshot is not None
                                 and app.snapshot.status.requests.paused == 1)
                snap = app.snapshot
                kv, counts = snap.status.kv, snap.status.requests
                assert _panel_text(app, "#status").startswith(" SERVING ")
                assert "worker ready" in _panel_text(app, "#status")
                assert (f"used {kv.used_blocks}/{kv.total_blocks}"
                        in _panel_text(app, "#kv"))
                assert f"free {kv.free_blocks}" in _panel_text(app, "#kv")
                assert f"paused {counts.paused}" in _panel_text(app, "#queues")
                table = app.query_one("#requests")
                (row,) = [table.get_row_at(i) for i in range(table.row_count)]
                listed = snap.detail.requests[0]
                assert row[0] == listed.request_id and row[1] == "alpha" and row[7] == "yes"
                tenants = app.query_one("#tenants")
                assert "alpha" in [tenants.get_row_at(i)[0] for i in range(tenants.row_count)]

                await pilot.press("x")
                assert isinstance(app.screen, ConfirmScreen)
                await pilot.press("y")
                await wait_until(pilot, lambda: app.last_reply is not None)
                assert app.last_reply.ok and app.last_reply.command == "cancel"

        drive(body)
        assert held.collect().finish_reason == "cancelled"


def test_drain_key_with_confirmation_rejects_new_requests_and_resume_restores(console_daemon):
    listen, control = console_daemon

    async def press_and_confirm(app, pilot, key: str, answer: str = "y") -> None:
        app.last_reply = None
        await pilot.press(key)
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press(answer)

    async def body():
        app = SluiceTop(control)
        async with app.run_test(size=(140, 48)) as pilot:
            await wait_until(pilot, lambda: app.connected)
            await press_and_confirm(app, pilot, "d", answer="n")
            await pilot.pause(0.3)
            assert app.last_reply is None and fetch_status_sync(control).state == "serving"
            await press_and_confirm(app, pilot, "d")
            await wait_until(pilot, lambda: app.last_reply is not None)
            await wait_until(pilot, lambda: app.snapshot.status.state == "draining")
            assert _panel_text(app, "#status").startswith(" DRAINING ")
            with Client(listen) as client, pytest.raises(SluiceError, match="draining"):
                client.generate("x", max_tokens=2)
            await press_and_confirm(app, pilot, "r")
            await wait_until(pilot, lambda: app.snapshot.status.state == "serving")
            with Client(listen) as client:
                assert client.generate("x", max_tokens=2).collect().finish_reason == "length"

    drive(body)


def test_reconcile_shows_its_report_and_recover_brings_the_worker_back(console_daemon):
    _, control = console_daemon
    assert send_command_sync(control, m.InjectFault("worker_down")).ok
    leaked = send_command_sync(control, m.InjectFault("leak_block"))  # after: a lost worker
    assert leaked.ok  # resets the pool, which would take the leak with it

    async def body():
        app = SluiceTop(control)
        async with app.run_test(size=(140, 48)) as pilot:
            await wait_until(pilot, lambda: app.snapshot is not None
                             and app.snapshot.status.worker.state != "ready")
            assert "worker restarting" in _panel_text(app, "#status")
            await pilot.press("n", "y")
            await wait_until(pilot, lambda: app.last_reply is not None)
            await wait_until(pilot, lambda: isinstance(app.screen, ReportScreen))
            assert any(f.startswith(f"block {leaked.message.split()[-1]} ")
                       for f in app.screen.reply.findings)
            await pilot.press("escape")
            await pilot.press("w", "y")
            await wait_until(pilot, lambda: app.snapshot.status.worker.state == "ready")
            assert "worker ready" in _panel_text(app, "#status")
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape")

    drive(body)
    assert fetch_status_sync(control, check_invariants=True).invariant_errors == ()


def test_console_shows_disconnected_and_reconnects_when_the_daemon_starts(tmp_path):
    control = f"ipc://{tmp_path}/late.sock"
    started = []

    async def body():
        import asyncio

        app = SluiceTop(control)
        async with app.run_test(size=(140, 48)) as pilot:
            await pilot.pause(0.2)
            assert not app.connected
            assert _panel_text(app, "#status").startswith(" DISCONNECTED ")
            process, _, _ = await asyncio.to_thread(start_console_daemon, tmp_path, "late")
            started.append(process)
            await wait_until(pilot, lambda: app.connected, timeout=15)
            assert _panel_text(app, "#status").startswith(" SERVING ")
            await asyncio.to_thread(assert_drained_and_consistent_sync, control)
            process.kill()
            process.wait()
            await wait_until(pilot, lambda: not app.connected, timeout=10)
            assert _panel_text(app, "#status").startswith(" DISCONNECTED ")

    try:
        drive(body)
    finally:
        for process in started:
            process.kill()
            process.wait()
