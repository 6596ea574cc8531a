"""Operations tests use the daemon fixtures every folder shares (`tests/daemon_fixtures.py`):
`sluiced`, `null_daemon`, `model_daemon`, `drained_and_consistent`."""

from daemon_support import (  # noqa: F401
    assert_consistent,
    assert_drained_and_consistent,
    start_daemon_process,
    start_sluiced,
)
