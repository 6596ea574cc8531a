"""End-to-end tests use the daemon fixtures every folder shares (`tests/daemon_fixtures.py`,
loaded by `tests/conftest.py`): `null_daemon`, `model_daemon`, `offline_greedy`, ...

The helpers stay importable from here under their old names for code that still looks here.
"""

from daemon_fixtures import MODEL_DAEMON_CONFIG, DaemonHandle  # noqa: F401
from daemon_support import (  # noqa: F401
    assert_consistent,
    assert_drained_and_consistent,
    start_daemon_process,
    start_sluiced,
)
