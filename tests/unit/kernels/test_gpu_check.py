"""The GPU check script: its code paths run (interpreter smoke) and it stays quiet without CUDA."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_check.py"


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",
                                                           "SLUICE_ATTENTION")}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=300, env=env)


def test_every_section_runs_under_the_interpreter(tmp_path):
    out = tmp_path / "report.json"
    done = run_script("--interpret-smoke", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert json.loads(done.stdout) == report
    parity = report["parity"]
    assert parity["failed"] == 0 and parity["total"] == len(parity["cases"]) > 0
    assert {c["kernel"] for c in parity["cases"]} == {"paged_attention", "reshape_and_cache"}
    assert {c["dtype"] for c in parity["cases"]} == {"fp32", "fp16"}
    bandwidth = report["bandwidth"]
    assert bandwidth["copy_bytes_per_s"] > 0
    assert all(r["bytes_per_s"] > 0 for r in bandwidth["results"])
    window = report["window"]
    assert window["failed"] == 0 and window["total"] == len(window["cases"]) > 0
    assert {(c["window"], c["softcap"]) for c in window["cases"]} == {(17, 0.0), (33, 30.0)}
    assert all(window["decode_time"][k] > 0 for k in ("full_ms", "window_ms"))
    engine = report["engine"]
    assert engine["attention"] == "triton"
    assert [d["batch"] for d in engine["decode"]] == [1, 2]
    assert all(d["tokens_per_s"] > 0 for d in engine["decode"])
    assert engine["prefill"]["tokens_per_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check runs")
def test_without_cuda_it_says_so_in_one_line_and_succeeds():
    done = run_script()
    assert done.returncode == 0
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA" in lines[0]
