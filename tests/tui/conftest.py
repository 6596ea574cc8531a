"""A null-executor `sluiced` process shared by the console tests (fault injection on). The
tests are sync and drive the console with `run_test()` on asyncio (`console_helpers.drive`):
the suite's trio mode does not reach them."""

from __future__ import annotations

import signal

import pytest
from console_helpers import start_console_daemon


@pytest.fixture(scope="module")
def console_daemon(tmp_path_factory):
    """(listen, control) of a null daemon; it must end consistent with nothing in use."""
    from sluice.ipc.control import fetch_status_sync

    folder = tmp_path_factory.mktemp("console")
    process, listen, control = start_console_daemon(folder, extra="[scheduler.tenants.alpha]\n")
    yield listen, control
    report = fetch_status_sync(control, check_invariants=True)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    assert report.invariant_errors == () and report.kv.used_blocks == 0
