"""Ctrl-C in the terminal that runs `sluiced serve`: SIGINT reaches the whole foreground
process group, and the daemon drains and exits 0 without a traceback from it or its worker,
whether it serves already or is still loading its model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from support.daemon import assert_drained_and_consistent_sync
from support.output import LineReader

pytestmark = pytest.mark.timeout(240)


class Terminal:
    """`sluiced serve ARGS` in a process group of its own, as a shell starts a foreground job
    (with SIGINT at its default: a suite run in the background inherits it ignored), and its
    merged output read line by line as it comes."""

    def __init__(self, tmp_path, *args: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sluice.daemon.main", "serve", "--listen",
             "tcp://127.0.0.1:0", "--control", f"ipc://{tmp_path}/control.sock", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "SLUICE_LOG_LEVEL": "info"}, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.output = LineReader(self.process.stdout)

    def read_until(self, marker: str, timeout: float) -> str:
        return self.output.until(marker, timeout)[-1]

    def ctrl_c(self) -> tuple[int, str]:
        """SIGINT to the process group, as the terminal sends it; (exit code, all output)."""
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"Ctrl-C did not stop the daemon in 60 s: "
                                 f"{self.output.seen[-20:]}") from None
        return code, "\n".join(self.output.rest(10))

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def test_ctrl_c_stops_a_serving_daemon_quietly(tmp_path) -> None:
    daemon = Terminal(tmp_path, "--executor", "null")
    try:
        ready = daemon.read_until("sluiced ready", 60)
        fields = dict(part.split("=", 1) for part in ready.split()[2:])
        assert_drained_and_consistent_sync(fields["control"])
        code, output = daemon.ctrl_c()
        assert code == 0, output[-3000:]
        assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
        assert '"stopped"' in output
    finally:
        daemon.kill()


def test_ctrl_c_while_the_model_loads_stops_before_serving(tmp_path) -> None:
    config = tmp_path / "sluiced.toml"
    config.write_text(f'[worker]\nruntime_dir = "{tmp_path}"\nnum_blocks = 64\n')
    daemon = Terminal(tmp_path, "--config", str(config))
    try:
        # logged before the worker starts, which takes seconds to load the model
        daemon.read_until('"starting"', 60)
        code, output = daemon.ctrl_c()
        assert code == 0, output[-3000:]
        assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
        assert "sluiced ready" not in output and "stopped before serving" in output
        # and no worker is left behind (its socket lives in tmp_path)
        end = time.monotonic() + 30
        while (left := processes_naming(str(tmp_path))) and time.monotonic() < end:
            time.sleep(0.1)
        assert not left, left
    finally:
        daemon.kill()


def processes_naming(text: str) -> list[str]:
    """Command lines of this machine's processes that contain `text`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in command:
            found.append(command)
    return found
