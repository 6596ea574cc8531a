"""Fault tests use the daemon fixtures every folder shares (`tests/daemon_fixtures.py`):
`null_daemon`, `daemon_process`, `model_daemon`, `drained_and_consistent`; a daemon a fault
stops must have had its KV checked by the test before it stopped."""

from daemon_support import (  # noqa: F401
    assert_consistent,
    assert_drained_and_consistent,
    start_daemon_process,
)
