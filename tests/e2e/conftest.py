"""Daemons for end-to-end and fault tests, each checked for KV consistency afterwards.

- `null_daemon`: start in-process daemons on the null executor (fast; actors reachable for
  fault injection).
- `model_daemon`: one real `sluiced serve` process on the embedded model for the session,
  with a real worker process; each test gets a handle and, when it ends, the daemon must
  drain to no live request with the KV invariant holding and no block in use.
- `offline_greedy`: greedy outputs of the in-process offline engine, to compare with.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from sluice.ipc import messages as m
from sluice.ipc.control import fetch_status

MODEL_DAEMON_CONFIG = """
[daemon]
drain_deadline = 20.0

[stream]
heartbeat_interval = 0.5
heartbeat_timeout = 2.0
pause_timeout = 2.0
high_watermark = 4
low_watermark = 1

[worker]
dtype = "float32"
num_blocks = 512
threads = 1
step_timeout = 60.0
"""


async def assert_drained_and_consistent(control: str, timeout: float = 30.0) -> m.StatusReport:
    """Wait until no request is live, then check the KV invariant and that no block leaked."""
    with trio.fail_after(timeout):
        while True:
            report = await fetch_status(control, check_invariants=True)
            live = report.requests.waiting + report.requests.running + report.requests.paused
            if live == 0 and report.kv.used_blocks == 0:
                break
            await trio.sleep(0.1)
    assert report.invariant_errors == ()
    kv = report.kv
    assert kv.free_blocks + kv.cached_blocks + kv.used_blocks == kv.total_blocks
    return report


@dataclass
class DaemonHandle:
    listen: str
    control: str
    process: subprocess.Popen | None = None
    daemon: object | None = None  # the in-process Daemon

    async def status(self) -> m.StatusReport:
        return await fetch_status(self.control, check_invariants=True)


@pytest.fixture
def drained_and_consistent():
    """`await drained_and_consistent(control)`, for tests that run their own daemon process."""
    return assert_drained_and_consistent


@pytest.fixture
async def null_daemon(nursery, tmp_path):
    """`await null_daemon(**overrides)` starts an in-process daemon on the null executor."""
    from sluice.daemon.config import load_config
    from sluice.daemon.server import Daemon

    started: list[DaemonHandle] = []

    async def start(**overrides) -> DaemonHandle:
        control = f"ipc://{tmp_path}/control-{len(started)}.sock"
        config = load_config(None, {"listen": "tcp://127.0.0.1:0", "control": control,
                                    "executor": "null", **overrides})
        daemon = await nursery.start(Daemon(config).run)
        handle = DaemonHandle(daemon.listen_address, daemon.control_address, daemon=daemon)
        started.append(handle)
        return handle

    yield start
    for handle in started:
        await assert_drained_and_consistent(handle.control)
        handle.daemon.stop()


def start_sluiced(args: list[str], *, env: dict[str, str] | None = None,
                  log: Path | None = None, log_level: str = "info",
                  timeout: float = 120.0) -> tuple[subprocess.Popen, dict[str, str]]:
    """Run `sluiced serve ARGS` and wait for its ready line.

    Returns (process, the ready line's fields: listen, control and maybe metrics)."""
    import selectors

    stderr = open(log, "w") if log is not None else subprocess.DEVNULL
    process = subprocess.Popen(
        [sys.executable, "-m", "sluice.daemon.main", "serve", *args],
        stdout=subprocess.PIPE, stderr=stderr, text=True,
        env={**os.environ, "SLUICE_LOG_LEVEL": log_level, **(env or {})},
    )
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    if not selector.select(timeout):
        process.kill()
        raise RuntimeError("sluiced did not become ready")
    line = process.stdout.readline()
    if not line.startswith("sluiced ready"):
        process.kill()
        raise RuntimeError(f"unexpected first line from sluiced: {line!r}")
    return process, dict(part.split("=", 1) for part in line.split()[2:])


def start_daemon_process(
    args: list[str], *, timeout: float = 240.0, log: Path | None = None
) -> tuple[subprocess.Popen, str, str]:
    """Run `sluiced serve ARGS` and wait for its ready line; return (process, listen, control)."""
    process, fields = start_sluiced(args, log=log, log_level="warning", timeout=timeout)
    return process, fields["listen"], fields["control"]


@pytest.fixture(scope="session")
def model_daemon_process():
    folder = Path(tempfile.mkdtemp(prefix="sluice-e2e-"))
    config = folder / "sluiced.toml"
    config.write_text(MODEL_DAEMON_CONFIG)
    process, listen, control = start_daemon_process(
        ["--config", str(config), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{folder}/control.sock"],
        log=folder / "sluiced.log",
    )
    yield DaemonHandle(listen, control, process)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()


@pytest.fixture
async def model_daemon(model_daemon_process):
    assert model_daemon_process.process.poll() is None, "the daemon died"
    yield model_daemon_process
    await assert_drained_and_consistent(model_daemon_process.control)
    assert model_daemon_process.process.poll() is None, "the daemon died"


@pytest.fixture(scope="session")
def offline_greedy():
    """`offline_greedy(prompt_ids, max_tokens) -> token ids` from the in-process engine.

    `offline_greedy.batch(list_of_prompt_ids, max_tokens)` computes many at once (the CPU is
    slow; one batch is far cheaper than one call per prompt); later calls hit the cache.
    """
    from sluice.actors.engine import Engine
    from sluice.actors.scheduler.plan import SamplingParams

    engine = Engine(None, dtype="float32", num_blocks=512)
    cache: dict[tuple, list[int]] = {}

    def batch(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        missing = [p for p in prompts if (tuple(p), max_tokens) not in cache]
        if missing:
            results = engine.generate([list(p) for p in missing],
                                      SamplingParams(temperature=0.0, max_tokens=max_tokens))
            for prompt, result in zip(missing, results):
                cache[(tuple(prompt), max_tokens)] = list(result.token_ids)
        return [cache[(tuple(p), max_tokens)] for p in prompts]

    def greedy(prompt_ids: list[int], max_tokens: int) -> list[int]:
        return batch([prompt_ids], max_tokens)[0]

    greedy.batch = batch
    greedy.tokenizer = engine.tokenizer
    return greedy
