"""Daemon fixtures for every test folder (a plugin `tests/conftest.py` loads), each ending with
the KV invariant checked — see `support/daemon.py` for the rule.

- `null_daemon`: in-process daemons on the null executor (fast; actors reachable for fault
  injection), checked at teardown.
- `sluiced` / `daemon_process`: `sluiced serve` processes; a live one is checked at teardown
  and killed, one that stopped during the test must have been checked by the test.
- `model_daemon`: one real `sluiced serve` process on the embedded model for the session,
  with a real worker process; each test gets a handle and, when it ends, the daemon must
  drain to no live request with the KV invariant holding and no block in use.
- `offline_greedy`: greedy outputs of the in-process offline engine, to compare with.
- `daemon_kv_checked` (autouse): fails a test that started a daemon which then stopped
  without its KV checked, whoever started it (a fixture, a helper, or `Daemon(...).run`).
"""

from __future__ import annotations

import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from support.daemon import (
    RECORD,
    StartedDaemon,
    assert_drained_and_consistent,
    keep_for_scope,
    start_daemon_process,
    start_sluiced,
    stop_checked,
)
from sluice.ipc import messages as m
from sluice.ipc.control import fetch_status

MODEL_DAEMON_CONFIG = """
[daemon]
drain_deadline = 20.0
debug_faults = true

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


@dataclass
class DaemonHandle:
    listen: str
    control: str
    process: subprocess.Popen | None = None
    daemon: object | None = None  # the in-process Daemon
    log: Path | None = None  # a process daemon's stderr (JSON lines)
    http: str | None = None  # HOST:PORT of its OpenAI-compatible front, when it has one

    async def status(self) -> m.StatusReport:
        return await fetch_status(self.control, check_invariants=True)

    async def check(self, timeout: float = 30.0) -> m.StatusReport:
        """The KV check, now: drained, invariant holding, no block in use."""
        return await assert_drained_and_consistent(self.control, timeout)


@pytest.fixture(autouse=True)
def daemon_kv_checked(monkeypatch):
    """Every daemon started in this test that stopped during it had its KV checked."""
    from sluice.daemon.server import Daemon

    RECORD.started.clear()
    run = Daemon.run

    async def recorded_run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        record: list[StartedDaemon] = []

        class Serving:  # the daemon counts from the moment it serves (a failed start never did)
            @staticmethod
            def started(value=None) -> None:
                record.append(RECORD.start(StartedDaemon(self.control_address, "in-process")))
                task_status.started(value)

        try:
            await run(self, task_status=Serving)
        finally:
            for started in record:
                started.stopped = True

    monkeypatch.setattr(Daemon, "run", recorded_run)
    yield
    for daemon in RECORD.started:  # started by the test itself and left running
        if daemon.process is not None and daemon.alive and not daemon.kept:
            stop_checked(daemon.process, daemon.control)
    unchecked = RECORD.unchecked_and_stopped()
    if unchecked:
        pytest.fail("daemon(s) stopped during the test without a KV check: "
                    + ", ".join(f"{d.kind} on {d.control}" for d in unchecked)
                    + " (call assert_drained_and_consistent or assert_consistent on the "
                    "control address before stopping it)", pytrace=False)


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


@pytest.fixture
def sluiced():
    """`sluiced(args, env=..., log=...)` -> (process, ready fields); at the end a live one is
    KV-checked and killed."""
    started: list[tuple[subprocess.Popen, str]] = []

    def start(args, **kwargs):
        process, fields = start_sluiced(args, **kwargs)
        started.append((process, fields["control"]))
        return process, fields

    yield start
    for process, control in started:
        stop_checked(process, control)


@pytest.fixture
def daemon_process():
    """`daemon_process(args, log=path)` -> (process, listen, control); at the end a live one is
    KV-checked and killed."""
    started: list[tuple[subprocess.Popen, str]] = []

    def start(args, **kwargs):
        process, listen, control = start_daemon_process(args, **kwargs)
        started.append((process, control))
        return process, listen, control

    yield start
    for process, control in started:
        stop_checked(process, control)


@pytest.fixture(scope="session")
def model_daemon_process():
    folder = Path(tempfile.mkdtemp(prefix="sluice-e2e-"))
    config = folder / "sluiced.toml"
    config.write_text(MODEL_DAEMON_CONFIG)
    process, fields = start_sluiced(
        ["--config", str(config), "--listen", "tcp://127.0.0.1:0",
         "--control", f"ipc://{folder}/control.sock", "--http", "127.0.0.1:0"],
        log=folder / "sluiced.log", log_level="warning", timeout=240.0,
    )
    keep_for_scope(process)  # each `model_daemon` test checks it; see below
    yield DaemonHandle(fields["listen"], fields["control"], process, log=folder / "sluiced.log",
                       http=fields["http"])
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
    from sluice.ipc.vocabulary import SamplingParams

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
    greedy.engine = engine  # for what the cache does not keep (logprobs)
    return greedy
