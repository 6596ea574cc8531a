"""`make run`, the quickstart's first command: the daemon answers the demo's question on the
embedded model, the answer stands on its own lines (the daemon's log lines, which share the
terminal, never land inside it), the daemon keeps serving, and Ctrl-C stops the demo, the
daemon and its worker quietly, with exit 0."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time

import pytest

from sluice.daemon.demo import QUESTION

from support.daemon import assert_drained_and_consistent_sync

pytestmark = pytest.mark.timeout(300)


def _lines_until(process: subprocess.Popen, marker: str, timeout: float) -> list[str]:
    """Lines of the demo's merged stdout and stderr, up to the one containing `marker`."""
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    lines: list[str] = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not selector.select(max(0.0, end - time.monotonic())):
            break
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if marker in line:
            return lines
    raise AssertionError(f"no line with {marker!r} within {timeout}s; got {lines[-20:]}")


def test_make_run_answers_and_keeps_serving_until_ctrl_c(tmp_path) -> None:
    control = f"ipc://{tmp_path}/control.sock"
    demo = subprocess.Popen(
        [sys.executable, "-m", "sluice.daemon.demo", "--listen", "tcp://127.0.0.1:0",
         "--control", control],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its daemon in its group: a failed test leaves no daemon
        # a suite started as a background job of a non-interactive shell inherits SIGINT
        # ignored, and a Python started so never turns Ctrl-C into KeyboardInterrupt:
        # start the demo as a terminal would
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = _lines_until(demo, "keeps serving", 240)
        asked = lines.index(f"> {QUESTION}")
        answer = lines[asked + 1]
        assert "Paris" in answer
        assert "request ended" not in answer and "{" not in answer, answer
        if not any("request ended" in line for line in lines[asked:]):
            # the daemon may log the request's end after the client has read its Finished
            lines += _lines_until(demo, "request ended", 30)
        logged = [line for line in lines[asked:] if "request ended" in line]
        assert logged and all(json.loads(line)["event"] == "request ended" for line in logged)
        assert_drained_and_consistent_sync(control)
        # keep reading what the demo relays, so that a full pipe never holds its daemon's log
        rest: list[str] = []
        reader = threading.Thread(target=lambda: rest.extend(demo.stdout), daemon=True)
        reader.start()
        os.killpg(demo.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole job
        try:
            assert demo.wait(timeout=60) == 0, rest[-20:]
        except subprocess.TimeoutExpired:
            raise AssertionError(f"Ctrl-C did not stop the demo in 60 s; it printed "
                                 f"{rest[-20:]}") from None
        reader.join(timeout=30)  # the daemon's last lines, and its worker's, if any
        assert not any("Traceback" in line or "KeyboardInterrupt" in line
                       for line in rest), rest[-40:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(demo.pid, signal.SIGKILL)
        demo.wait()
