"""The data path's promise, counted by `benchmarks/serialization.py`: every message between
actors is encoded, and a step's sampled tokens cross each hop between the worker's sampler
and the client socket in one message per step (per connection past the Tokenizer), never one
per token; the benchmark that counts them still drives a whole daemon to the end, with its KV
pool consistent after."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serialization.py"


def test_a_step_s_tokens_cross_each_hop_in_messages_per_step_not_per_token():
    # 64 requests on the benchmark client's 8 connections: 8 requests' tokens a connection
    done = subprocess.run([sys.executable, str(SCRIPT), "--requests", "64", "--max-tokens", "8",
                           "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["delivered_tokens"] == report["sampled_tokens"] == 64 * 8
    assert report["steps"] > 0
    hops = {(row["hop"], row["op"]): row for row in report["token_passes"]}
    assert ("stream -> client (wire frame)", "encode") in hops  # the frame the client reads
    for actors in ("scheduler -> tokenizer", "tokenizer -> stream", "stream -> gateway"):
        assert {(actors, "encode"), (actors, "decode")} <= set(hops)  # over the socket
    tokens_per_step = report["sampled_tokens"] / report["steps"]
    for (hop, op), row in hops.items():
        if row["by"] == "client codec":  # one envelope a chunk, in one frame a connection
            continue
        # a step's tokens in one message (and an admission told between steps now and then),
        # one a connection past the Tokenizer: at most the client's 8 connections, and far
        # fewer than one a token
        assert row["per_step"] <= min(8, tokens_per_step / 2), (row, tokens_per_step)
    # the daemon it drove ended with no block leaked or owned twice
    assert report["kv_after"] == {"used_blocks": 0, "accounted": True, "invariant_errors": []}
