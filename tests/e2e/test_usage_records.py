"""Usage records: one JSON line per ended request, which sums exactly to the per-tenant
Prometheus counters and to what the clients were told, whose timings are ordered, which a
restarted daemon appends to, and which a reopen (SIGHUP's) moves to a fresh file."""

from __future__ import annotations

import json
import signal
from collections import Counter

import pytest
import trio

from sluice.ipc import messages as m
from sluice.ipc.client import AsyncClient
from sluice.ipc.control import fetch_status, send_command

from support.daemon import assert_drained_and_consistent, http_get, samples

pytestmark = pytest.mark.timeout(240)

TOKEN_KINDS = ("prompt", "completion", "cached", "recomputed")
POINTS = ("tokenized", "queued", "scheduled", "prefill_done", "first_token", "finished")


def read_records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def wait_for_records(path, count: int) -> list[dict]:
    with trio.fail_after(10):
        while not path.exists() or len(path.read_text().splitlines()) < count:
            await trio.sleep(0.02)
    return read_records(path)


async def test_usage_file_sums_to_the_counters_and_the_clients(null_daemon, tmp_path) -> None:
    path = tmp_path / "usage.jsonl"
    # a's KV cap (4 blocks of 16 tokens) holds one of two 40-token requests, not both: the
    # younger is preempted when they grow, and recomputes
    tenants = {"a": {"max_kv_blocks": 4}, "b": {}}
    handle = await null_daemon(metrics_port=0, scheduler={"tenants": tenants},
                               **{"usage.path": str(path), "stream.pause_timeout": 0.5})
    told: dict[str, list] = {"a": [], "b": []}
    with trio.fail_after(60):
        async with AsyncClient(handle.listen, tenant="a") as a, \
                AsyncClient(handle.listen, tenant="b") as b, \
                AsyncClient(handle.listen, tenant="b", credit_window=1) as slow:
            for i in range(3):
                told["a"].append(await (await a.generate(f"alpha {i}", max_tokens=8)).collect())
            pair = [await a.generate(f"alpha pair {i}", max_tokens=40) for i in range(2)]
            told["a"] += [await generation.collect() for generation in pair]
            for i in range(2):
                told["b"].append(await (await b.generate(f"beta {i}", max_tokens=5)).collect())
            cancelled = await b.generate("beta long", max_tokens=3000)
            await cancelled.__anext__()  # a token arrived: it runs
            await cancelled.cancel()
            told["b"].append(await cancelled.collect())
            unread = await slow.generate("beta unread", max_tokens=3000)  # never read: paused
            while (await fetch_status(handle.control)).requests.paused < 1:
                await trio.sleep(0.02)
            await trio.sleep(1.0)  # past pause_timeout, unread: it times out
            told["b"].append(await unread.collect())
    records = await wait_for_records(path, 9)
    assert len(records) == 9 and len({r["request_id"] for r in records}) == 9
    reasons = Counter((r["tenant"], r["finish_reason"]) for r in records)
    assert reasons == {("a", "length"): 5, ("b", "length"): 2, ("b", "cancelled"): 1,
                       ("b", "timeout"): 1}
    preempted = [r for r in records if r["preemptions"]]
    assert len(preempted) == 1 and preempted[0]["recomputed_tokens"] > 0

    # the file equals what each client was told
    for tenant, results in told.items():
        mine = [r for r in records if r["tenant"] == tenant]
        assert sorted(r["completion_tokens"] for r in mine) == sorted(
            res.usage.completion_tokens for res in results)
        assert sum(r["prompt_tokens"] for r in mine) == sum(res.usage.prompt_tokens
                                                            for res in results)
        assert sum(r["recomputed_tokens"] for r in mine) == sum(
            res.usage.recomputed_tokens for res in results)
        assert Counter(r["finish_reason"] for r in mine) == Counter(res.finish_reason
                                                                    for res in results)

    # ... and the per-tenant counters of /metrics
    status, text = await http_get(handle.daemon.metrics_port, "/metrics")
    assert status == 200
    values = samples(text)
    for tenant in ("a", "b"):
        mine = [r for r in records if r["tenant"] == tenant]
        for kind in TOKEN_KINDS:
            assert values[("sluice_tenant_usage_tokens_total",
                           (("kind", kind), ("tenant", tenant)))] == sum(
                r[f"{kind}_tokens"] for r in mine)
        for reason, count in Counter(r["finish_reason"] for r in mine).items():
            assert values[("sluice_tenant_usage_requests_total",
                           (("reason", reason), ("tenant", tenant)))] == count
        assert values[("sluice_tenant_usage_kv_block_seconds_total", (("tenant", tenant),))] \
            == pytest.approx(sum(r["kv_block_seconds"] for r in mine))
        assert values[("sluice_tenant_usage_preemptions_total", (("tenant", tenant),))] == sum(
            r["preemptions"] for r in mine)
    assert values[("sluice_e2e_request_latency_seconds_count", (("tenant", "b"),))] == 4
    assert values[("sluice_preemptions_by_cause_total", (("cause", "memory"),))] == 1
    assert values[("sluice_preemptions_by_cause_total", (("cause", "priority"),))] == 0
    assert values[("sluice_time_to_first_token_seconds_count", (("tenant", "a"),))] == 5

    # every point in order, each span from its own points
    for r in records:
        t = r["timings"]
        assert r["kv_block_seconds"] > 0 and r["start"] <= r["end"]
        assert 0 < t["tokenized"] <= t["queued"] <= t["scheduled"] <= t["prefill_done"] \
            <= t["first_token"] <= t["finished"], t
        assert t["queue"] == pytest.approx(t["scheduled"] - t["queued"])
        assert t["prefill"] == pytest.approx(t["prefill_done"] - t["scheduled"])
        assert t["ttft"] == t["first_token"] and t["e2e"] == t["finished"]
    unread_record = next(r for r in records if r["finish_reason"] == "timeout")
    assert unread_record["timings"]["e2e"] >= 0.5  # it waited out its pause

    # a reopen (what SIGHUP does) lets go of a rotated file: later records go to a new one
    path.rename(tmp_path / "usage.jsonl.1")
    handle.daemon.reopen_usage_log()
    async with AsyncClient(handle.listen, tenant="a") as a:
        await (await a.generate("after rotation", max_tokens=2)).collect()
    assert [r["finish_reason"] for r in await wait_for_records(path, 1)] == ["length"]
    assert len(read_records(tmp_path / "usage.jsonl.1")) == 9


async def test_sighup_reopens_the_usage_file_and_a_restart_appends(sluiced, tmp_path) -> None:
    path = tmp_path / "usage.jsonl"
    args = ["--executor", "null", "--listen", "tcp://127.0.0.1:0",
            "--control", f"ipc://{tmp_path}/control.sock", "--usage-log", str(path)]
    process, fields = sluiced(args, log=tmp_path / "first.log")
    async with AsyncClient(fields["listen"]) as client:
        await (await client.generate("one", max_tokens=3)).collect()
        first = await wait_for_records(path, 1)
        path.rename(tmp_path / "usage.jsonl.1")  # rotated away
        process.send_signal(signal.SIGHUP)
        with trio.fail_after(10):  # the reopen makes the file again
            while not path.exists():
                await trio.sleep(0.02)
        await (await client.generate("two", max_tokens=4)).collect()
    second = await wait_for_records(path, 1)
    assert [r["completion_tokens"] for r in second] == [4]
    assert read_records(tmp_path / "usage.jsonl.1") == first
    await assert_drained_and_consistent(fields["control"])  # the first daemon, before it stops
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    process, fields = sluiced(args, log=tmp_path / "second.log")  # restarted
    async with AsyncClient(fields["listen"]) as client:
        await (await client.generate("three", max_tokens=5)).collect()
    after = await wait_for_records(path, 2)
    assert after[0] == second[0]  # kept as it was
    assert after[1]["completion_tokens"] == 5
    assert len({r["request_id"] for r in [*first, *after]}) == 3


async def test_a_held_queue_shows_in_queue_not_in_prefill_or_delivery(null_daemon,
                                                                        tmp_path) -> None:
    path = tmp_path / "usage.jsonl"
    handle = await null_daemon(debug_faults=True, **{"usage.path": str(path)})
    with trio.fail_after(60):
        # with the worker stopped, nothing is stepped: an arrival waits in the queue
        assert (await send_command(handle.control, m.InjectFault("worker_down"))).ok
        while (await fetch_status(handle.control)).worker.state == "ready":
            await trio.sleep(0.02)
        async with AsyncClient(handle.listen) as client:
            waiter = await client.generate("waits for the worker", max_tokens=4)
            await trio.sleep(0.6)
            recovering = trio.current_time()
            assert (await send_command(handle.control, m.RecoverCommand())).ok
            assert (await waiter.collect()).finish_reason == "length"
            after_recover = trio.current_time() - recovering
    t = (await wait_for_records(path, 1))[0]["timings"]
    assert t["queue"] >= 0.5  # the wait is the queue's ...
    # ... not the rest's: everything after the queue happened after the recover
    assert t["ttft"] - t["queue"] <= after_recover
    assert t["ttft"] >= t["queue"]


async def test_withheld_credits_show_in_delivery_not_in_queue_or_prefill(null_daemon) -> None:
    handle = await null_daemon()
    with trio.fail_after(30):
        async with AsyncClient(handle.listen, credit_window=1) as client:
            # more tokens than the stream buffers before it pauses the request, so the
            # request cannot end before the client reads on, however fast the steps are
            sent = trio.current_time()
            generation = await client.generate("read slowly", max_tokens=1000)
            await generation.__anext__()  # the first chunk used the one credit
            first_chunk = trio.current_time() - sent
            await trio.sleep(0.5)  # one more credit meanwhile: the stream holds the rest
            result = await generation.collect()
    t = result.timings
    assert result.finish_reason == "length" and len(result.token_ids) == 1000
    assert t.finished - t.first_token >= 0.45  # the wait is delivery's ...
    # ... not the rest's: the daemon's first token left before the client read it
    assert t.queue <= t.ttft <= first_chunk and t.prefill <= t.ttft
    assert t.tpot == pytest.approx((t.finished - t.first_token) / 999)


async def test_a_long_prompt_shows_in_prefill(model_daemon) -> None:
    with trio.fail_after(120):
        async with AsyncClient(model_daemon.listen) as client:
            short = await (await client.generate(prompt_ids=[1, 504, 3458], max_tokens=1,
                                                  temperature=0)).collect()
            ids = [1] + [504, 3458, 282, 2114, 314, 253] * 200  # 1201 tokens
            long = await (await client.generate(prompt_ids=ids, max_tokens=1,
                                                 temperature=0)).collect()
    assert long.usage.prompt_tokens == 1201
    # computing 400 times the prompt is what takes the time, not the queue or the delivery
    assert long.timings.prefill > 5 * short.timings.prefill
    assert long.timings.prefill > long.timings.queue
    assert long.timings.prefill >= 0.5 * long.timings.ttft
