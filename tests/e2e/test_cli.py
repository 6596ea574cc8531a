"""The `sluice` commands that talk to a daemon: status, generate --connect, bench."""

from __future__ import annotations

import json
import subprocess
import sys

import trio

from sluice.ipc import messages as m
from sluice.ipc.control import send_command


async def sluice(*args: str) -> subprocess.CompletedProcess:
    return await trio.to_thread.run_sync(lambda: subprocess.run(
        [sys.executable, "-m", "sluice.daemon.cli", *args], capture_output=True, text=True,
        timeout=120,
    ))


async def test_status_json_has_the_operator_shape(null_daemon) -> None:
    daemon = await null_daemon()
    with trio.fail_after(120):
        done = await sluice("status", "--connect-control", daemon.control, "--json", "--check")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["state"] == "serving"
    assert set(status["worker"]) >= {"state", "restarts"}
    assert set(status["kv"]) >= {"total_blocks", "free_blocks", "used_blocks", "cached_blocks"}
    assert set(status["requests"]) >= {"waiting", "running", "paused"}
    assert set(status["counters"]) >= {"accepted", "finished", "cancelled", "rejected",
                                       "preemptions"}
    assert status["kv"]["total_blocks"] > 0 and status["invariant_errors"] == []


async def test_generate_connect_json_matches_the_offline_shape(null_daemon) -> None:
    daemon = await null_daemon()
    with trio.fail_after(120):
        done = await sluice("generate", "--connect", daemon.listen, "--prompt", "hi",
                            "--max-tokens", "5", "--stop", "brown", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["text"] == " the quick "
    assert out["finish_reason"] == "stop"
    assert len(out["token_ids"]) == 3
    assert out["usage"]["completion_tokens"] == 3 and out["usage"]["prompt_tokens"] > 0


async def test_generate_connect_reports_a_rejection(null_daemon) -> None:
    daemon = await null_daemon()
    with trio.fail_after(120):
        done = await sluice("generate", "--connect", daemon.listen, "--prompt", "hi",
                            "--top-p", "3", "--json")
    assert done.returncode == 2
    assert "top_p" in done.stderr


async def test_bench_json_reports_latency_percentiles(null_daemon) -> None:
    daemon = await null_daemon(scheduler={"tenants": {"a": {}, "b": {}}})  # only these exist
    with trio.fail_after(120):
        done = await sluice("bench", "--connect", daemon.listen, "--connect-control",
                            daemon.control, "--concurrency", "8", "--requests", "24",
                            "--max-tokens", "6", "--ignore-eos", "--tenants", "a:2,b:1",
                            "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["completed"] == 24 and report["rejected"] == 0
    assert report["output_tokens"] == 24 * 6
    assert report["output_tokens_per_s"] > 0 and report["seconds"] > 0
    for name in ("ttft", "tpot", "itl", "e2e"):
        assert set(report[name]) == {"p50", "p95", "p99"}
        assert report[name]["p50"] <= report[name]["p99"]
    assert set(report["tenants"]) == {"a", "b"} and 0 < report["jain_index"] <= 1
    assert report["preemptions"] == 0


async def test_bench_http_drives_the_openai_front_with_the_same_report(null_daemon) -> None:
    daemon = await null_daemon(**{"http.listen": "127.0.0.1:0", "http.tenants": {
        "a": ["key-a"], "b": ["key-b"]}})
    url = f"http://{daemon.daemon.http_address}"
    with trio.fail_after(120):
        done = await sluice("bench", "--http", url, "--api-key", "a=key-a", "--api-key",
                            "b=key-b", "--concurrency", "8", "--requests", "24",
                            "--max-tokens", "6", "--ignore-eos", "--tenants", "a:2,b:1",
                            "--json")
        refused = await sluice("bench", "--http", url, "--requests", "2", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["completed"] == 24 and report["rejected"] == 0
    assert report["output_tokens"] == 24 * 6 and report["finish_reasons"] == {"length": 24}
    for name in ("ttft", "tpot", "itl", "e2e"):
        assert report[name]["p50"] is not None and report[name]["p50"] <= report[name]["p99"]
    assert {name: t["requests"] for name, t in report["tenants"].items()}.keys() == {"a", "b"}
    assert sum(t["requests"] for t in report["tenants"].values()) == 24
    # each tenant's requests ran as that tenant: its API key chose it
    snapshot = await send_command(daemon.control, m.Subscribe(ttl=1.0))
    for name in ("a", "b"):
        assert snapshot.detail.tenants[name].totals.finished == report["tenants"][name]["requests"]
    # without a key the front refuses (even GET /v1/models): the bench says so and fails
    assert refused.returncode == 2 and "401" in refused.stderr
