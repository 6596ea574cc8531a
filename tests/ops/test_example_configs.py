"""The example configs beside the unit: the production one (CUDA, /run, /var/lib) parses, and
the minimal CPU one is what a newcomer can run as it is: the embedded model on the CPU, the
runtime directory's default sockets, nothing under /run or /var, and `sluiced` serves with it."""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path

import pytest
from support.daemon import assert_drained_and_consistent

from sluice.daemon.config import load_config
from sluice.daemon.preflight import check_startup

pytestmark = pytest.mark.timeout(120)

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
CPU = SYSTEMD / "sluiced.cpu.toml"


def _strings(value) -> list[str]:
    if dataclasses.is_dataclass(value):
        return [s for field in dataclasses.fields(value)
                for s in _strings(getattr(value, field.name))]
    if isinstance(value, dict):
        return [s for item in value.values() for s in _strings(item)]
    return [str(value)] if isinstance(value, str | Path) else []


def test_the_production_config_parses() -> None:
    config = load_config(SYSTEMD / "sluiced.toml")
    assert config.worker.device == "cuda"


def test_the_cpu_config_runs_the_embedded_model_on_the_cpu_with_default_sockets() -> None:
    config = load_config(CPU)
    assert config.worker.device == "cpu" and config.executor == "model"
    assert config.control is None  # the runtime directory's socket, as `sluice status` finds it
    assert not [s for s in _strings(config) if s.startswith(("/run", "/var"))]
    # the checks `sluiced serve` makes before loading: the model is there, the device exists
    check_startup(load_config(CPU, {"listen": "tcp://127.0.0.1:0", "http.listen": "127.0.0.1:0"}))


async def test_sluiced_serves_with_the_cpu_config(sluiced, tmp_path) -> None:
    # the fake executor: the file's settings are read and checked, no model is loaded
    process, fields = sluiced(["--config", str(CPU), "--executor", "null",
                               "--listen", "tcp://127.0.0.1:0", "--http", "127.0.0.1:0",
                               "--control", f"ipc://{tmp_path}/control.sock"])
    assert fields["http"].startswith("127.0.0.1:")
    await assert_drained_and_consistent(fields["control"])
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
