"""Operator commands over the control socket against a real (null-executor) daemon: drain and
resume, cancel, tenant changes, reconcile of injected orphans, recover of a stopped worker."""

from __future__ import annotations

import pytest
import structlog.testing
import trio

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status, send_command
from sluice.ipc.vocabulary import SluiceError

pytestmark = pytest.mark.timeout(240)  # a hang fails this test instead of the suite


async def _wait_for(control: str, predicate, timeout: float = 10.0) -> m.StatusReport:
    with trio.fail_after(timeout):
        while True:
            report = await fetch_status(control)
            if predicate(report):
                return report
            await trio.sleep(0.02)


async def test_drain_rejects_new_requests_and_resume_admits_again(null_daemon) -> None:
    handle = await null_daemon()
    with trio.fail_after(30):
        async with AsyncClient(handle.listen) as client:
            reply = await send_command(handle.control, m.DrainCommand())
            assert reply.ok and (await fetch_status(handle.control)).state == "draining"
            try:
                await client.generate("x", max_tokens=4)
            except SluiceError as exc:
                assert "draining" in str(exc)
            else:
                raise AssertionError("a draining daemon accepted a request")
            assert (await send_command(handle.control, m.ResumeCommand())).ok
            await _wait_for(handle.control, lambda r: r.state == "serving")
            result = await (await client.generate("x", max_tokens=4, temperature=0)).collect()
            assert result.finish_reason == "length"


async def test_drain_deadline_cancels_what_is_still_running(null_daemon) -> None:
    handle = await null_daemon()
    with trio.fail_after(30):
        async with AsyncClient(handle.listen, credit_window=1) as client:
            stuck = await client.generate("x", max_tokens=3000, ignore_eos=True)
            await _wait_for(handle.control, lambda r: r.requests.paused == 1)
            await send_command(handle.control, m.DrainCommand(deadline=0.2))
            result = await stuck.collect()
            assert result.finish_reason == "cancelled"
            await send_command(handle.control, m.ResumeCommand())


async def test_cancel_by_daemon_id_ends_the_request_for_its_client(null_daemon) -> None:
    handle = await null_daemon()
    with trio.fail_after(30):
        async with AsyncClient(handle.listen, credit_window=1) as client:
            generation = await client.generate("x", max_tokens=3000)
            snap = await send_command(handle.control, m.Subscribe(ttl=0.5))
            (listed,) = snap.detail.requests
            assert listed.request_id.endswith("/" + generation.request_id)
            reply = await send_command(handle.control, m.CancelCommand(listed.request_id))
            assert reply.ok
            assert (await generation.collect()).finish_reason == "cancelled"
            again = await send_command(handle.control, m.CancelCommand(listed.request_id))
            assert not again.ok and "no live request" in again.message


async def test_tenant_set_limits_admission(null_daemon) -> None:
    handle = await null_daemon()
    with trio.fail_after(30):
        reply = await send_command(handle.control, m.TenantSet("batch", weight=2.0, max_queued=0,
                                                               max_running=0))
        assert reply.ok
        async with AsyncClient(handle.listen, tenant="batch") as client:
            try:
                await client.generate("x", max_tokens=4)
            except SluiceError as exc:
                assert "quota" in str(exc) or "tenant" in str(exc)
            else:
                raise AssertionError("a tenant over its limits was admitted")
        bad = await send_command(handle.control, m.TenantSet("batch", weight=-1.0))
        assert not bad.ok and "weight" in bad.message
        snap = await send_command(handle.control, m.Subscribe(ttl=0.5))
        assert snap.detail.tenants["batch"].weight == 2.0


async def test_reconcile_frees_a_leaked_block_and_a_request_whose_stream_vanished(
        null_daemon) -> None:
    handle = await null_daemon(debug_faults=True, **{"stream.high_watermark": 2,
                                                     "stream.low_watermark": 1})
    with trio.fail_after(30):
        async with AsyncClient(handle.listen, credit_window=1) as client:
            await client.generate("orphan to be", max_tokens=3000, ignore_eos=True)
            await _wait_for(handle.control, lambda r: r.requests.paused == 1)
            vanished = await send_command(handle.control, m.InjectFault("vanish_stream"))
            leaked = await send_command(handle.control, m.InjectFault("leak_block"))
            assert vanished.ok and leaked.ok
            broken = await fetch_status(handle.control, check_invariants=True)
            assert broken.invariant_errors and broken.requests.paused == 1

            reply = await send_command(handle.control, m.ReconcileCommand())
            assert reply.ok and len(reply.findings) == 2, reply.findings
            block = leaked.message.split()[-1]
            assert any(f.startswith(f"block {block} ") for f in reply.findings)
            assert any("no live connection" in f for f in reply.findings)
            fixed = await fetch_status(handle.control, check_invariants=True)
            assert fixed.invariant_errors == ()
            assert fixed.requests.paused == 0 and fixed.kv.used_blocks == 0
            again = await send_command(handle.control, m.ReconcileCommand())
            assert again.findings == ()


async def test_faults_are_refused_unless_the_daemon_allows_them(null_daemon) -> None:
    handle = await null_daemon()
    reply = await send_command(handle.control, m.InjectFault("leak_block"))
    assert not reply.ok and "disabled" in reply.message
    report = await fetch_status(handle.control, check_invariants=True)
    assert report.invariant_errors == () and report.kv.used_blocks == 0


async def test_recover_brings_a_stopped_worker_back_and_serving_resumes(null_daemon) -> None:
    handle = await null_daemon(debug_faults=True)
    with trio.fail_after(30):
        assert (await send_command(handle.control, m.InjectFault("worker_down"))).ok
        down = await _wait_for(handle.control, lambda r: r.worker.state != "ready")
        async with AsyncClient(handle.listen) as client:
            waiting = await client.generate("x", max_tokens=5, temperature=0)
            await _wait_for(handle.control, lambda r: r.requests.waiting == 1)
            assert not waiting.done  # held in the queue, not failed, while no worker runs
            reply = await send_command(handle.control, m.RecoverCommand())
            assert reply.ok, reply.message
            result = await waiting.collect()
            assert result.finish_reason == "length" and len(result.token_ids) == 5
        up = await _wait_for(handle.control, lambda r: r.worker.state == "ready")
        assert up.worker.restarts == down.worker.restarts + 1


async def test_a_worker_loss_names_leaked_blocks_before_the_pool_resets(null_daemon) -> None:
    handle = await null_daemon(debug_faults=True)
    with trio.fail_after(30):
        leaked = await send_command(handle.control, m.InjectFault("leak_block"))
        block = int(leaked.message.split()[-1])
        with structlog.testing.capture_logs() as logs:
            assert (await send_command(handle.control, m.InjectFault("worker_down"))).ok
            await _wait_for(handle.control, lambda r: r.worker.state != "ready")
        lost = [e for e in logs if e["event"] == "worker lost with KV blocks owned by no request"]
        assert [e["blocks"] for e in lost] == [[block]]
        assert (await send_command(handle.control, m.RecoverCommand())).ok
        await _wait_for(handle.control, lambda r: r.worker.state == "ready")
