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
drained_and_consistent = _e2e.drained_and_consistent
assert_drained_and_consistent = _e2e.assert_drained_and_consistent
start_daemon_process = _e2e.start_daemon_process
start_sluiced = _e2e.start_sluiced


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
