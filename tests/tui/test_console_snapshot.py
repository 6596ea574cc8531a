"""Pins the look of the main screen: a fixed snapshot rendered at a fixed size must give the
SVG stored beside this file. After an intended change of the look, regenerate it with
`SLUICE_UPDATE_SNAPSHOTS=1` (that run fails on purpose), review the new SVG, rerun. A missing
SVG fails: the test never passes by comparing a screen with itself."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from support.console import drive

from sluice.ipc import messages as m
from sluice.tui.app import SluiceTop

pytestmark = pytest.mark.timeout(240)  # a hang fails this test instead of the suite

GOLDEN = Path(__file__).parent / "snapshots" / "main_screen.svg"


def fixed_snapshot() -> m.ControlSnapshot:
    status = m.StatusReport(
        state="serving", worker=m.WorkerStatus("ready", 1, 4242),
        kv=m.KVStatus(total_blocks=1024, free_blocks=600, used_blocks=384, cached_blocks=40),
        requests=m.RequestCounts(waiting=3, running=4, paused=1),
        counters=m.Counters(accepted=120, finished=110, cancelled=2, rejected=5, preemptions=7),
        connections=3)
    detail = m.ConsoleDetail(
        queues={"waiting": 3, "prefilling": 1, "decoding": 3, "paused": 1, "preempted": 0},
        kv=m.KVDetail(high_watermark=0.95, low_watermark=0.85, admission_open=True),
        last_step=m.PlanComposition(prefill_tokens=512, decode_tokens=3),
        latency=m.LatencySummary(tokens_per_second=1830.0, ttft=m.Percentiles(p50=0.042),
                                 itl=m.Percentiles(p50=0.0121)),
        tenants={
            "chat": m.TenantRow(
                weight=4.0, running=3, waiting=1, queues={"decoding": 3, "waiting": 1},
                limits=m.TenantLimits(max_priority=10, timeout=120.0),
                totals=m.TenantTotals(service=3000.0, prefill_tokens=2400, decode_tokens=600,
                                      preemptions=2)),
            "batch": m.TenantRow(
                weight=1.0, running=1, waiting=2,
                queues={"prefilling": 1, "waiting": 2, "paused": 1},
                limits=m.TenantLimits(max_queued=1024, output_tokens_per_minute=6000),
                output_tokens_available=4200.0,
                totals=m.TenantTotals(service=1000.0, prefill_tokens=900, decode_tokens=100,
                                      preemptions=5)),
        },
        requests=tuple(
            m.RequestRow(f"0a0b0c0d/{i}", "chat" if i % 2 else "batch",
                         "decoding" if i < 4 else "waiting", age=1.5 * i, prompt_tokens=100 + i,
                         output_tokens=10 * i, blocks=i, paused=i == 2)
            for i in range(6)
        ),
    )
    return m.ControlSnapshot(seq=1, status=status, detail=detail)


def test_main_screen_looks_as_pinned() -> None:
    async def body() -> str:
        app = SluiceTop("ipc:///run/sluice/control.sock", connect=False)
        async with app.run_test(size=(120, 44)) as pilot:
            app.apply_snapshot(fixed_snapshot())
            await pilot.pause()
            return app.export_screenshot(title="sluice top")

    svg = drive(body)
    if os.environ.get("SLUICE_UPDATE_SNAPSHOTS") == "1":
        # writing the pin never passes: what was just written compares equal to itself
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(svg)
        pytest.fail(f"rewrote {GOLDEN.name}; review it, then rerun without "
                    "SLUICE_UPDATE_SNAPSHOTS", pytrace=False)
    assert GOLDEN.exists(), (f"the pinned screen {GOLDEN.name} is missing; generate it with "
                             "SLUICE_UPDATE_SNAPSHOTS=1, review it and commit it")
    assert svg == GOLDEN.read_text(), f"the main screen changed; compare with {GOLDEN.name}"


def test_a_snapshot_without_detail_shows_the_status_and_zeros() -> None:
    async def body() -> None:
        app = SluiceTop("ipc:///run/sluice/control.sock", connect=False)
        async with app.run_test(size=(120, 44)) as pilot:
            app.apply_snapshot(replace(fixed_snapshot(), detail=None))
            await pilot.pause()
            assert app.query_one("#queues").plain.startswith("waiting 0 prefilling 0")
            assert app.query_one("#kv").plain == ("used 384/1024 (38%)  free 600  cached 40  "
                                                  "L 100% H 100%")
            assert app.query_one("#latency").plain.startswith("tokens/s 0  TTFT p50 0.0 ms")
            assert app.query_one("#tenants").row_count == app.query_one("#requests").row_count == 0

    drive(body)
