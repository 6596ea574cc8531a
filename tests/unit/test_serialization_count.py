"""The data path's promise, counted by `benchmarks/serialization.py`: a step's sampled tokens
are encoded or decoded in at most three passes between the worker's sampler and the client
socket, and the benchmark that counts them still drives a whole daemon to the end, with
its KV pool consistent after."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serialization.py"


def test_a_step_s_tokens_cross_at_most_three_serialization_passes():
    done = subprocess.run([sys.executable, str(SCRIPT), "--requests", "8", "--max-tokens", "8",
                           "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["delivered_tokens"] == report["sampled_tokens"] == 8 * 8
    assert report["steps"] > 0
    hops = {(row["hop"], row["op"]) for row in report["token_passes"]}
    assert ("stream -> client (wire frame)", "encode") in hops  # the frame the client reads
    assert report["passes_per_token"] == len(hops) <= 3, report["token_passes"]
    # the daemon it drove ended with no block leaked or owned twice
    assert report["kv_after"] == {"used_blocks": 0, "accounted": True, "invariant_errors": []}
