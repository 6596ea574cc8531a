"""Fault tests share the in-process daemon fixtures of the end-to-end suite."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "sluice_e2e_fixtures", Path(__file__).parent.parent / "e2e" / "conftest.py"
)
_e2e = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _e2e  # dataclasses look their module up while the file runs
_spec.loader.exec_module(_e2e)

null_daemon = _e2e.null_daemon
drained_and_consistent = _e2e.drained_and_consistent
assert_drained_and_consistent = _e2e.assert_drained_and_consistent
start_daemon_process = _e2e.start_daemon_process


@pytest.fixture
def daemon_process():
    """`daemon_process(args, log=path)` runs `sluiced serve ARGS`; killed at the end if alive."""
    started = []

    def start(args, **kwargs):
        process, listen, control = start_daemon_process(args, **kwargs)
        started.append(process)
        return process, listen, control

    yield start
    for process in started:
        process.kill()
        process.wait()
