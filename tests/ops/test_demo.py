"""`make run`, the quickstart's first command: the daemon answers the demo's question on the
embedded model, the answer stands on its own lines (the daemon's log lines, which share the
terminal, never land inside it), the daemon keeps serving, and Ctrl-C stops the demo, the
daemon and its worker quietly, with exit 0. What a newcomer reads is clean: one hint, the
daemon's and its worker's log in one readable format (no JSON), durations to the
millisecond, no warning, no traceback, and no news of the demo's own client leaving."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys

import pytest

from sluice.daemon.demo import QUESTION

from support.daemon import assert_drained_and_consistent_sync
from support.output import LineReader

pytestmark = pytest.mark.timeout(300)

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
    output = LineReader(demo.stdout)
    try:
        lines = output.until("keeps serving", 240)
        listen = next(line for line in lines if line.startswith("sluiced ready")).split()[2]
        listen = listen.removeprefix("listen=")
        asked = lines.index(f"> {QUESTION}")
        answer = lines[asked + 1]
        assert "Paris" in answer
        assert "request ended" not in answer and "{" not in answer, answer
        if not any("request ended" in line for line in lines[asked:]):
            # the daemon may log the request's end after the client has read its Finished
            output.until("request ended", 30)
        logged = [line for line in output.seen[asked:] if "request ended" in line]
        assert logged and not any(line.startswith("{") for line in logged), logged
        # seconds to the millisecond, never `e2e=2.1831291079997754`
        assert re.search(r"\be2e=\d+\.?\d*", logged[0]), logged
        assert not re.search(r"=\d*\.\d{4,}", logged[0]), logged
        assert_drained_and_consistent_sync(control)
        os.killpg(demo.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole job
        try:
            code = demo.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"Ctrl-C did not stop the demo in 60 s; it printed "
                                 f"{output.seen[-20:]}") from None
        everything = output.rest(30)  # the daemon's last lines, and its worker's, if any
        assert code == 0, everything[-20:]
        assert not any("Traceback" in line or "KeyboardInterrupt" in line
                       for line in everything), everything[-40:]
        # the daemon's log and its worker's alike (the model loading, the KV pool): readable
        loading = [line for line in everything if "loading model" in line]
        assert loading and "SmolLM2" in loading[0] and "MB" in loading[0], everything[:20]
        assert any("model loaded" in line for line in everything), everything[:20]
        assert any("kv pool sized" in line for line in everything), everything[:20]
        assert not [line for line in everything if line.lstrip().startswith('{"')]
        assert not [line for line in everything if "warning" in line.lower()]
        assert [line for line in everything if "sluice chat --connect" in line] == [
            f"  .venv/bin/sluice chat --connect {listen}"]
        assert not [line for line in everything if "client gone" in line]
        assert any("stopped" in line for line in everything), everything[-20:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(demo.pid, signal.SIGKILL)
        demo.wait()
