"""`/metrics` and `/health` under load: the text parses, latency histograms fill, the KV gauge
equals the snapshot, and health turns 503 while draining."""

from __future__ import annotations

import pytest
import trio

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status, send_command

from support.daemon import http_get, samples

pytestmark = pytest.mark.timeout(240)  # a hang fails this test instead of the suite


async def test_metrics_under_load_match_the_snapshot(null_daemon) -> None:
    handle = await null_daemon(metrics_port=0, scheduler={"tenants": {"a": {}}})
    port = handle.daemon.metrics_port
    with trio.fail_after(60):
        async with AsyncClient(handle.listen, credit_window=1) as slow, \
                AsyncClient(handle.listen, tenant="a") as fast:
            async with trio.open_nursery() as nursery:
                for i in range(6):
                    nursery.start_soon((await fast.generate(f"p{i}", max_tokens=20)).collect)
            held = [await slow.generate("x" * 40, max_tokens=3000) for _ in range(3)]
            while (await fetch_status(handle.control)).requests.paused < 3:
                await trio.sleep(0.02)
            status, text = await http_get(port, "/metrics")
            report = await fetch_status(handle.control)
            assert status == 200
            values = samples(text)
            for state, number in (("free", report.kv.free_blocks),
                                  ("used", report.kv.used_blocks),
                                  ("cached", report.kv.cached_blocks)):
                assert values[("sluice_kv_blocks", (("state", state),))] == number
            assert report.kv.used_blocks > 0
            assert values[("sluice_time_to_first_token_seconds_count", (("tenant", "a"),))] == 6
            assert values[("sluice_inter_token_latency_seconds_count", (("tenant", "a"),))] > 0
            assert values[("sluice_decode_batch_size_count", ())] > 0
            assert values[("sluice_prefill_chunk_tokens_count", ())] >= 9
            assert values[("sluice_requests_total", (("outcome", "accepted"),))] == 9
            assert values[("sluice_tenant_requests_total",
                           (("outcome", "finished"), ("tenant", "a")))] == 6

            assert await http_get(port, "/health") == (200, "serving\n")
            await send_command(handle.control, m.DrainCommand())
            assert (await http_get(port, "/health"))[0] == 503
            await send_command(handle.control, m.ResumeCommand())
            while (await fetch_status(handle.control)).state != "serving":
                await trio.sleep(0.02)
            assert (await http_get(port, "/health"))[0] == 200
            for generation in held:
                await generation.cancel()
