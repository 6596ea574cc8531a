"""`make run`: start `sluiced serve` on the embedded model, show it answering one question
through the client library, then keep serving in the foreground until Ctrl-C.

A thin wrapper so that the quickstart shows the daemon working end to end; the daemon
itself is plain `sluiced serve`. Its log (stderr) is relayed line by line, and held back
while the answer is printed, so that no log line lands in the middle of the answer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import IO

QUESTION = "What is the capital of France?"
CHAT_HINT = "chat with it:"  # how the daemon's own line after its ready line begins


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # the log reaches a person through our pipe: readable lines, the daemon's and its
    # worker's alike, unless the caller chose a format; coloured if we write to a terminal
    env = {"SLUICE_LOG_FORMAT": "console", **os.environ}
    if sys.stderr.isatty() and not os.environ.get("NO_COLOR"):
        env.setdefault("FORCE_COLOR", "1")
    daemon = subprocess.Popen([sys.executable, "-m", "sluice.daemon.main", "serve", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    log = _LogRelay(daemon.stderr)
    try:
        address = _wait_ready(daemon)
        if address is None:  # it refused to start (its reason went to stderr), or was stopped
            return _exit_code(daemon.wait())
        with log.held():
            _ask(address)
        print(f"\nthe daemon keeps serving on {address}; chat with it from another terminal:\n"
              f"  .venv/bin/sluice chat --connect {address}\n(Ctrl-C stops it)", flush=True)
        for line in daemon.stdout:  # keep relaying the daemon's own output
            if not line.startswith(CHAT_HINT):  # said above already, with the path to it
                print(line, end="", flush=True)
        return _exit_code(daemon.wait())
    except KeyboardInterrupt:
        # a terminal's Ctrl-C reached the daemon too, which drains and stops: this stays
        # quiet while it does (another Ctrl-C included), and says the daemon's exit code
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)  # or only we were interrupted
        return _exit_code(daemon.wait())
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=60)
        log.thread.join(timeout=5)  # the daemon's last lines (its drain) still come through


def _exit_code(returncode: int) -> int:
    """The daemon's exit code as a shell reports it: 128 + N for a death by signal N."""
    return returncode if returncode >= 0 else 128 - returncode


class _LogRelay:
    """Copies the daemon's log lines to our stderr, except while `held()`: then they wait."""

    def __init__(self, source: IO[str]):
        self.lock = threading.Lock()
        self.waiting: list[str] | None = None  # a list while held
        self.thread = threading.Thread(target=self._copy, args=(source,), daemon=True)
        self.thread.start()

    def _copy(self, source: IO[str]) -> None:
        for line in source:
            with self.lock:
                if self.waiting is not None:
                    self.waiting.append(line)
                    continue
                sys.stderr.write(line)
                sys.stderr.flush()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self.lock:
            self.waiting = []
        try:
            yield
        finally:
            with self.lock:
                sys.stdout.flush()
                sys.stderr.writelines(self.waiting or [])
                sys.stderr.flush()
                self.waiting = None


def _wait_ready(daemon: subprocess.Popen) -> str | None:
    for line in daemon.stdout:
        print(line, end="", flush=True)
        if line.startswith("sluiced ready"):
            fields = dict(part.split("=", 1) for part in line.split()[2:] if "=" in part)
            return fields.get("listen")
    return None


def _ask(address: str) -> None:
    from sluice.ipc.client import Client

    print(f"\n> {QUESTION}", flush=True)
    with Client(address) as client:
        generation = client.generate(messages=[{"role": "user", "content": QUESTION}],
                                     max_tokens=64, temperature=0.0)
        for chunk in generation:
            print(chunk.text, end="", flush=True)
    print(flush=True)


if __name__ == "__main__":
    sys.exit(main())
