"""The console's status line says when the worker `failed` to start, why, and how to retry."""

from __future__ import annotations

from textual.app import App, ComposeResult

from sluice.ipc import messages as m
from sluice.tui.status_bar import StatusBar

from support.console import drive


class _OneBar(App):
    def compose(self) -> ComposeResult:
        yield StatusBar("ipc:///run/sluice/control.sock")


def _snapshot(worker: m.WorkerStatus) -> m.ControlSnapshot:
    return m.ControlSnapshot(1, m.StatusReport("serving", worker, m.KVStatus(),
                                               m.RequestCounts(), m.Counters()))


def test_the_status_line_shows_a_failed_worker_and_its_reason() -> None:
    async def body() -> None:
        app = _OneBar()
        async with app.run_test() as pilot:
            bar = app.query_one(StatusBar)
            bar.show(_snapshot(m.WorkerStatus("failed", 3, 0, "worker exited with 3")), True)
            await pilot.pause()
            assert "worker failed (worker exited with 3; w retries now)" in bar.plain
            bar.show(_snapshot(m.WorkerStatus("ready", 4, 1234)), True)
            await pilot.pause()
            assert "worker ready (restarts 4)" in bar.plain
            assert "retries" not in bar.plain

    drive(body)
