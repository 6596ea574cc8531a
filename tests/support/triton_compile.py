"""Run a script with the real Triton compiler (no interpreter), for kernels that must compile
for a GPU this machine does not have."""

from __future__ import annotations

import os
import subprocess
import sys


def compiled_output(script: str) -> str:
    """The stdout of `script` run in a fresh interpreter with `TRITON_INTERPRET` unset and
    torch's float fusion on; fails the test with its stderr if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
