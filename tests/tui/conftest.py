"""A null-executor `sluiced` process shared by the console tests (fault injection on). The
tests are sync and drive the console with `run_test()` on asyncio (`support.console.drive`):
the suite's trio mode does not reach them."""

from __future__ import annotations

import signal

import pytest
from support.console import start_console_daemon
from support.daemon import assert_drained_and_consistent_sync, keep_for_scope


@pytest.fixture(scope="module")
def console_daemon(tmp_path_factory):
    """(listen, control) of a null daemon; it must end consistent with nothing in use."""
    folder = tmp_path_factory.mktemp("console")
    process, listen, control = start_console_daemon(folder, extra="[scheduler.tenants.alpha]\n")
    keep_for_scope(process)  # checked here, once every test of the module used it
    yield listen, control
    assert_drained_and_consistent_sync(control)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
