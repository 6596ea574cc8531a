"""`make run`: start `sluiced serve` on the embedded model, show it answering one question
through the client library, then keep serving in the foreground until Ctrl-C.

A thin wrapper so that the quickstart shows the daemon working end to end; the daemon
itself is plain `sluiced serve`.
"""

from __future__ import annotations

import signal
import subprocess
import sys

QUESTION = "What is the capital of France?"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    daemon = subprocess.Popen([sys.executable, "-m", "sluice.daemon.main", "serve", *args],
                              stdout=subprocess.PIPE, text=True)
    try:
        address = _wait_ready(daemon)
        if address is None:
            return daemon.wait() or 1
        _ask(address)
        print(f"\nthe daemon keeps serving on {address}; chat with it from another terminal:\n"
              f"  .venv/bin/sluice chat --connect {address}\n(Ctrl-C stops it)", flush=True)
        for line in daemon.stdout:  # keep relaying the daemon's own output
            print(line, end="", flush=True)
        return daemon.wait()
    except KeyboardInterrupt:
        daemon.send_signal(signal.SIGTERM)
        return daemon.wait()
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=60)


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
