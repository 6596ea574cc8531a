"""A process of the worker's that outlives no parent: the worker itself (its parent is the
daemon) and the other ranks of a tensor-parallel group (theirs is the worker). One left behind
would hold its memory (and a GPU) for nobody, or wait in a collective for a group that is
gone."""

from __future__ import annotations

import os
import threading
import time

PARENT_CHECK_SECONDS = 0.5


def die_with_parent(parent: int | None = None) -> None:
    """Exit when the parent goes away, even mid-load or inside a step that never returns: a
    thread polls the parent pid, since a main thread stuck in native code never reaches a
    check of its own. (Not prctl's PR_SET_PDEATHSIG: it fires when the parent *thread* that
    spawned us exits, and trio spawns processes from its worker threads, which end when
    idle.) `parent` is the parent's pid as it said: one that died while this process was
    starting left it adopted already, and the adoptive parent would be watched for good."""
    if parent is None:
        parent = os.getppid()
    if os.getppid() != parent:
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_SECONDS)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
