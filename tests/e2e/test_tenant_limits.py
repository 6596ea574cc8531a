"""Tenant limits through a real daemon (null executor, real sockets and actors): a request's
timeout ends it while it waits and while its client withholds credits, a tenant's default
timeout applies, and a tenant over its token rate is refused with a retry-after on both
fronts. The core's own tests (tests/unit/scheduler/test_tenant_limits_core.py) hold the rates to
±10% and the KV cap over whole floods."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import trio

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status, send_command
from sluice.ipc.vocabulary import InvalidRequestError, QuotaError

pytestmark = pytest.mark.timeout(120)


async def _worker_down(control: str) -> None:
    assert (await send_command(control, m.InjectFault("worker_down"))).ok
    while (await fetch_status(control)).worker.state == "ready":
        await trio.sleep(0.02)


async def test_timeouts_end_waiting_and_paused_requests_and_free_their_kv(null_daemon) -> None:
    handle = await null_daemon(debug_faults=True,
                               scheduler={"tenants": {"slow": {"timeout": 0.6}}})
    with trio.fail_after(60):
        async with AsyncClient(handle.listen, credit_window=1) as client:
            # a client that stops reading: its request pauses holding KV, then times out
            paused = await client.generate("never read", max_tokens=3000, timeout=0.8)
            while (await fetch_status(handle.control)).requests.paused < 1:
                await trio.sleep(0.02)
            assert (await fetch_status(handle.control)).kv.used_blocks > 0
            # the client reads only once the timeout has ended the paused request: reading
            # earlier would grant credits and let it run on
            while (await fetch_status(handle.control)).requests.paused > 0:
                await trio.sleep(0.02)
            result = await paused.collect()
            assert result.finish_reason == "timeout" and 0 < len(result.token_ids) < 3000

            # with no worker nothing runs: a waiting request times out all the same, by its
            # own timeout or its tenant's default
            await _worker_down(handle.control)
            own = await client.generate("waits", max_tokens=4, timeout=0.5)
            default = await client.generate("waits too", max_tokens=4, tenant="slow")
            assert (await own.collect()).finish_reason == "timeout"
            assert (await default.collect()).finish_reason == "timeout"
            assert (await default.collect()).timings.scheduled == 0.0  # never ran
            assert (await send_command(handle.control, m.RecoverCommand())).ok
            done = await client.generate("after", max_tokens=3, timeout=30)
            assert (await done.collect()).finish_reason == "length"

            with pytest.raises(InvalidRequestError) as bad:
                await client.generate("x", max_tokens=2, timeout=-1.0)
            assert bad.value.field == "timeout"
    status = await fetch_status(handle.control)
    assert status.kv.used_blocks == 0


async def test_a_tenant_over_its_rate_is_refused_with_a_retry_after(null_daemon) -> None:
    limits = {"output_tokens_per_minute": 120, "max_queue_wait": 5.0}
    # the same limits for a tenant of the ZeroMQ socket and one that owns an HTTP key (a
    # keyed tenant is refused on the unauthenticated socket)
    tenants = {"metered": limits, "keyed": limits}
    handle = await null_daemon(scheduler={"tenants": tenants},
                               **{"http.listen": "127.0.0.1:0", "http.model_name": "limits-test",
                                  "http.tenants": {"keyed": ["key-m"]}})
    with trio.fail_after(60):
        async with AsyncClient(handle.listen, tenant="metered") as client:
            with pytest.raises(QuotaError) as alone:  # more than a minute's tokens
                await client.generate("x", max_tokens=121)
            assert alone.value.field == "sampling.max_tokens" and alone.value.retry_after == 0.0
            first = await client.generate("takes the minute", max_tokens=120,
                                          ignore_eos=True)
            assert len((await first.collect()).token_ids) == 120
            with pytest.raises(QuotaError) as refused:  # the bucket is empty: a minute away
                await client.generate("y", max_tokens=60)
            assert refused.value.field == "tenant"
            assert 25.0 <= refused.value.retry_after <= 31.0
            # another tenant is not held back
            other = await client.generate("z", max_tokens=60, tenant="default")
            assert (await other.collect()).finish_reason == "length"

        address = handle.daemon.http_address
        model = "limits-test"
        status, _, body = await _post(address, {"model": model, "prompt": "takes the minute",
                                                "max_tokens": 120, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 120
        status, headers, body = await _post(address, {"model": model, "prompt": "y",
                                                      "max_tokens": 60})
        assert status == 429 and body["error"]["code"] == "quota_exceeded"
        assert 25 <= int(headers["retry-after"]) <= 31
        status, _, body = await _post(address, {"model": model, "prompt": "y",
                                                "max_tokens": 2, "timeout": "soon"})
        assert status == 400 and body["error"]["param"] == "timeout"


async def _post(address: str, body: dict) -> tuple[int, dict, dict]:
    """POST /v1/completions as tenant "keyed", off the event loop: (status, headers, JSON)."""
    def post() -> tuple[int, dict, dict]:
        request = urllib.request.Request(
            f"http://{address}/v1/completions", data=json.dumps(body).encode(),
            headers={"Authorization": "Bearer key-m", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, _lower(reply.headers), json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _lower(exc.headers), json.loads(exc.read())

    return await trio.to_thread.run_sync(post)


def _lower(headers) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}
