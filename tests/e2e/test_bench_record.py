"""`sluice bench` records what it ran against: the arrival process, the prompt and output
lengths the daemon counted, and with `--connect-control` the daemon's model, settings and KV
peak, over the ZeroMQ client and over the HTTP front.

The bench runs in-process (`bench.bench`, what `--json` prints) against `null_daemon`, whose
teardown checks the KV invariant.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from sluice.actors.scheduler import SchedulerConfig
from sluice.daemon import version
from sluice.daemon.cli import build_parser
from sluice.daemon.commands.bench import bench
from sluice.daemon.commands.bench_record import header

PROMPT_LENGTHS = (5, 17, 40)  # the workload's prompts, cycled in this order
SCHEDULER = {"policy": "fcfs", "token_budget": 256, "max_running": 64, "max_prefilling": 2,
             "max_prefill_chunk": 128}


def workload(folder: Path) -> str:
    path = folder / "workload.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": list(range(100, 100 + n))}) + "\n"
                            for n in PROMPT_LENGTHS))
    return str(path)


def bench_args(*argv: str):
    return build_parser("bench").parse_args(["bench", *argv, "--json"])


def assert_runs_against(daemon_record: dict, total_blocks: int) -> None:
    """The daemon facts of a `--connect-control` run against `null_daemon(scheduler=SCHEDULER)`."""
    assert daemon_record["version"] == version()
    assert daemon_record["executor"] == "null" and "null" in daemon_record["model"]
    assert daemon_record["model_path"].endswith(".gguf")
    assert daemon_record["device"] is None and daemon_record["dtype"] is None  # no model runs
    expected = SchedulerConfig.from_dict({**SCHEDULER, "kv_blocks": 1})
    assert daemon_record["scheduler"] == {
        name: getattr(expected, name) for name in daemon_record["scheduler"]}
    assert {"token_budget", "max_running", "max_prefilling", "max_prefill_chunk", "policy",
            "block_size"} <= set(daemon_record["scheduler"])
    kv = daemon_record["kv"]
    assert kv["total_blocks"] == total_blocks
    assert 0 < kv["peak_used_blocks"] <= kv["total_blocks"]
    assert kv["used_blocks_at_end"] == 0 and kv["samples"] >= 2


async def test_with_control_it_records_the_daemon_and_its_kv_peak(null_daemon, tmp_path) -> None:
    daemon = await null_daemon(scheduler=SCHEDULER)
    total_blocks = (await daemon.status()).kv.total_blocks
    # long enough for several KV samples while 32 requests are in flight
    args = bench_args("--connect", daemon.listen, "--connect-control", daemon.control,
                      "--workload", workload(tmp_path), "--concurrency", "32", "--duration",
                      "1.2", "--max-tokens", "48", "--ignore-eos")
    with trio.fail_after(60):
        report = await bench(args)
    run = report["run"]
    assert run["sluice_version"] == version()
    assert run["target"] == {"connect": daemon.listen}
    assert run["arrival"] == {"process": "closed", "concurrency": 32, "requests": None,
                              "duration": 1.2}
    completed = report["completed"]
    assert completed >= len(PROMPT_LENGTHS) and report["rejected"] == 0
    output, prompt = run["output_tokens"], run["prompt_tokens"]
    assert output["count"] == completed
    assert output["min"] == output["p50"] == output["max"] == output["mean"] == 48
    assert prompt["count"] == completed
    assert (prompt["min"], prompt["max"]) == (min(PROMPT_LENGTHS), max(PROMPT_LENGTHS))
    assert_runs_against(run["daemon"], total_blocks)
    assert report["preemptions"] == 0
    text = "\n".join(header(run))
    assert "closed loop, 32 in flight, 1.2s" in text
    assert f"peak {run['daemon']['kv']['peak_used_blocks']}/{total_blocks} blocks" in text
    assert "fcfs  token_budget 256  max_running 64  max_prefilling 2  prefill_chunk 128" in text


async def test_without_control_the_daemon_is_not_recorded(null_daemon, tmp_path) -> None:
    daemon = await null_daemon()
    args = bench_args("--connect", daemon.listen, "--workload", workload(tmp_path), "--rate",
                      "300", "--requests", "30", "--max-tokens", "8", "--ignore-eos")
    with trio.fail_after(60):
        report = await bench(args)
    run = report["run"]
    assert run["daemon"] is None and report["preemptions"] is None
    assert run["arrival"] == {"process": "poisson", "rate": 300.0, "requests": 30,
                              "duration": None}
    assert report["completed"] == 30
    assert run["output_tokens"] == {"count": 30, "min": 8, "p50": 8, "p90": 8, "p99": 8,
                                    "max": 8, "mean": 8.0}
    # each prompt ten times: the distribution of what was sent
    prompt = run["prompt_tokens"]
    assert (prompt["count"], prompt["min"], prompt["p50"], prompt["p90"], prompt["max"]) == (
        30, 5, 17, 40, 40)
    assert prompt["mean"] == pytest.approx(sum(PROMPT_LENGTHS) / len(PROMPT_LENGTHS))
    text = "\n".join(header(run))
    assert "poisson 300 req/s, 30 requests" in text
    assert "daemon  not recorded (give --connect-control to record it)" in text


async def test_http_records_the_same_run(null_daemon, tmp_path) -> None:
    daemon = await null_daemon(scheduler=SCHEDULER, **{"http.listen": "127.0.0.1:0"})
    url = f"http://{daemon.daemon.http_address}"
    total_blocks = (await daemon.status()).kv.total_blocks
    args = bench_args("--http", url, "--connect-control", daemon.control, "--workload",
                      workload(tmp_path), "--concurrency", "16", "--duration", "1.2",
                      "--max-tokens", "32", "--ignore-eos")
    with trio.fail_after(60):
        report = await bench(args)
    run = report["run"]
    assert run["target"] == {"http": url}
    completed = report["completed"]
    assert completed >= len(PROMPT_LENGTHS) and report["rejected"] == 0
    output, prompt = run["output_tokens"], run["prompt_tokens"]
    assert output["count"] == prompt["count"] == completed
    assert output["min"] == output["p50"] == output["max"] == 32
    assert (prompt["min"], prompt["max"]) == (min(PROMPT_LENGTHS), max(PROMPT_LENGTHS))
    assert_runs_against(run["daemon"], total_blocks)
