"""Operations tests share the in-process daemon fixtures of the end-to-end suite."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_NAME = "sluice_e2e_fixtures"
if _NAME in sys.modules:
    _e2e = sys.modules[_NAME]
else:
    _spec = importlib.util.spec_from_file_location(
        _NAME, Path(__file__).parent.parent / "e2e" / "conftest.py"
    )
    _e2e = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = _e2e  # dataclasses look their module up while the file runs
    _spec.loader.exec_module(_e2e)

null_daemon = _e2e.null_daemon
assert_drained_and_consistent = _e2e.assert_drained_and_consistent
start_daemon_process = _e2e.start_daemon_process


def start_sluiced(args: list[str], *, env: dict[str, str] | None = None, log=None,
                  timeout: float = 120.0):
    """Run `sluiced serve ARGS` with extra environment; wait for its ready line.

    Returns (process, fields of the ready line: listen, control and maybe metrics)."""
    import os
    import selectors
    import subprocess

    stderr = open(log, "w") if log is not None else subprocess.DEVNULL
    process = subprocess.Popen(
        [sys.executable, "-m", "sluice.daemon.main", "serve", *args],
        stdout=subprocess.PIPE, stderr=stderr, text=True,
        env={**os.environ, "SLUICE_LOG_LEVEL": "info", **(env or {})},
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


@pytest.fixture
def sluiced():
    """`sluiced(args, env=..., log=...)`; processes still alive at the end are killed."""
    started = []

    def start(args, **kwargs):
        process, fields = start_sluiced(args, **kwargs)
        started.append(process)
        return process, fields

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()
