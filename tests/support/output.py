"""A child process's merged output, line by line as it comes: read by a thread, so a line
already written is never left waiting for more output, with colour escapes removed (a
caller's FORCE_COLOR would colour a log)."""

from __future__ import annotations

import queue
import re
import threading
import time

ESCAPES = re.compile(r"\x1b\[[0-9;]*m")


class LineReader:
    def __init__(self, stream):
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []  # every line handed out so far
        self.thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.put(ESCAPES.sub("", line.rstrip("\n")))
        self.lines.put(None)

    def until(self, marker: str, timeout: float) -> list[str]:
        """The lines up to the one containing `marker`, from where the last call stopped."""
        taken: list[str] = []
        end = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError(f"no line with {marker!r} within {timeout}s; "
                                     f"got {(self.seen + taken)[-20:]}")
            taken.append(line)
            if marker in line:
                self.seen += taken
                return taken

    def rest(self, timeout: float) -> list[str]:
        """Every line, once the output has ended (within `timeout` seconds)."""
        self.thread.join(timeout=timeout)
        while (line := self.lines.get_nowait() if not self.lines.empty() else None) is not None:
            self.seen.append(line)
        return self.seen
