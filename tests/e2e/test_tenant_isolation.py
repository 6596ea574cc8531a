"""Tenant isolation through a real daemon (null executor, real sockets and actors): which
tenants a client may name, per-tenant prefix caches, queue caps of unconfigured tenants, and
bounded per-tenant state and metric labels under a flood of one-off names."""

from __future__ import annotations

import urllib.request

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status, send_command
from sluice.ipc.vocabulary import InvalidRequestError, QuotaError

PROMPT = "Tell me everything about the rivers of Europe, from the Danube to the Rhine. " * 3


async def test_an_unknown_tenant_is_rejected_and_an_operator_created_one_is_served(
    null_daemon,
) -> None:
    handle = await null_daemon()
    with trio.fail_after(30):
        async with AsyncClient(handle.listen) as client:
            with pytest.raises(InvalidRequestError) as caught:
                await (await client.generate("hi", max_tokens=2, tenant="invented")).collect()
            assert caught.value.field == "tenant"
            reply = await send_command(handle.control, m.TenantSet("invented", weight=2.0))
            assert reply.ok, reply.message
            result = await (await client.generate("hi", max_tokens=2, tenant="invented")).collect()
            assert result.finish_reason == "length"
            result = await (await client.generate("hi", max_tokens=2)).collect()  # "default"
            assert result.finish_reason == "length"


async def test_open_tenants_serve_a_client_named_tenant(null_daemon) -> None:
    handle = await null_daemon(**{"limits.open_tenants": True})
    with trio.fail_after(30):
        async with AsyncClient(handle.listen, tenant="anyone") as client:
            result = await (await client.generate("hi", max_tokens=2)).collect()
            assert result.finish_reason == "length"


async def _cached_tokens(client: AsyncClient, tenant: str) -> int:
    result = await (await client.generate(PROMPT, max_tokens=2, tenant=tenant)).collect()
    return result.usage.cached_tokens


async def test_cache_hits_stay_inside_a_tenant_unless_it_opts_in(null_daemon) -> None:
    tenants = {"alpha": {}, "beta": {}, "shared-a": {"share_prefix_cache": True},
               "shared-b": {"share_prefix_cache": True}}
    handle = await null_daemon(scheduler={"tenants": tenants})
    with trio.fail_after(30):
        async with AsyncClient(handle.listen) as client:
            assert await _cached_tokens(client, "alpha") == 0
            assert await _cached_tokens(client, "beta") == 0  # no hit on alpha's blocks
            assert await _cached_tokens(client, "alpha") > 0  # the same tenant repeating hits
            assert await _cached_tokens(client, "shared-a") == 0
            assert await _cached_tokens(client, "shared-b") > 0  # both opted in: shared


async def test_an_unconfigured_tenant_hits_the_default_queue_cap(null_daemon) -> None:
    handle = await null_daemon(debug_faults=True, scheduler={"tenants": {"capped": {}}},
                               **{"limits.default_tenant_max_queued": 2})
    with trio.fail_after(30):
        # with the worker down nothing is admitted, so requests stay queued
        assert (await send_command(handle.control, m.InjectFault("worker_down"))).ok
        while (await fetch_status(handle.control)).worker.state == "ready":
            await trio.sleep(0.02)
        async with AsyncClient(handle.listen, tenant="capped") as client:
            queued = [await client.generate("x", max_tokens=2) for _ in range(2)]
            with pytest.raises(QuotaError) as caught:
                await (await client.generate("x", max_tokens=2)).collect()
            assert caught.value.field == "tenant"
            assert (await send_command(handle.control, m.RecoverCommand())).ok
            for generation in queued:
                assert (await generation.collect()).finish_reason == "length"


def _metrics_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def _tenant_labels(text: str) -> set[str]:
    return {sample.labels["tenant"]
            for family in text_string_to_metric_families(text) for sample in family.samples
            if "tenant" in sample.labels}


async def test_one_off_tenants_leave_no_scheduling_state_and_bounded_labels(null_daemon) -> None:
    handle = await null_daemon(metrics_port=0, scheduler={"tenants": {"known": {}}},
                               **{"limits.open_tenants": True})
    names = [f"once-{i}" for i in range(300)]
    with trio.fail_after(120):
        async with AsyncClient(handle.listen) as client:
            await (await client.generate("x", max_tokens=2, tenant="known")).collect()
            for start in range(0, len(names), 50):
                async with trio.open_nursery() as nursery:
                    for name in names[start:start + 50]:
                        generation = await client.generate("x", max_tokens=2, tenant=name)
                        nursery.start_soon(generation.collect)
        text = await trio.to_thread.run_sync(_metrics_text, handle.daemon.metrics_port)
    assert _tenant_labels(text) == {"default", "known", "(other)"}
    core = handle.daemon.scheduler.core
    assert core.ledger.tenants == {} and core.waiting.tenants == frozenset()
    assert all(core.ledger.usage[name].finished == 1 for name in names)  # the counters remain
    stats = core.stats()
    assert set(stats["tenants"]) == {"default", "known"}
    assert stats["other_tenants"]["finished"] == len(names)
