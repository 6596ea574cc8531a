"""Logging for sluiced: structlog, JSON lines when stderr is not a TTY (journald), a
readable console otherwise. The worker process, which shares the daemon's stderr and
environment, chooses by the same rule (`log_format_is_json`), so a terminal shows one format.
Durations are seconds, logged to the millisecond.

Log lines carry request ids, tenants, token counts and timings, never prompt or output
text: `drop_text` removes any field whose name says it holds text, so a careless call site
cannot leak a prompt into the journal.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

TEXT_FIELDS = frozenset({"prompt", "prompt_text", "text", "output", "output_text", "messages",
                         "content", "completion", "delta"})


def drop_text(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    for name in TEXT_FIELDS & event.keys():
        event[name] = "<redacted>"
    return event


def round_floats(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    """Floats in a log line are durations in seconds (or ratios): a millisecond is precision
    enough, and `e2e=2.1831291079997754` is noise on a terminal."""
    for name, value in event.items():
        if type(value) is float:
            event[name] = round(value, 3)
    return event


def log_format_is_json() -> bool:
    """JSON unless stderr is a TTY, or whatever `SLUICE_LOG_FORMAT` (`console` or `json`)
    says: a wrapper that relays the log to a terminal through a pipe says `console`."""
    chosen = os.environ.get("SLUICE_LOG_FORMAT", "")
    return chosen == "json" or (chosen != "console" and not sys.stderr.isatty())


def log_colors() -> bool:
    """Console lines are coloured on a TTY (unless `NO_COLOR`), or where `FORCE_COLOR` asks
    (a wrapper relaying to a terminal): never escape codes in a file."""
    if os.environ.get("FORCE_COLOR"):
        return True
    return sys.stderr.isatty() and not os.environ.get("NO_COLOR")


class _StderrLogger:
    """Writes each line to `sys.stderr` as it is when the line is written, not as it was when
    logging was configured: whoever runs the CLI in-process (tests, embedding code) may swap
    stderr and close the old one."""

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


def configure_logging(level: str = "info", *, json: bool | None = None) -> None:
    """Console logs on a TTY, JSON otherwise (`log_format_is_json`); `level` is a logging
    level name."""
    if json is None:
        json = log_format_is_json()
    processors: list[Any] = [structlog.contextvars.merge_contextvars,
                             structlog.processors.add_log_level,
                             structlog.processors.TimeStamper("iso"), drop_text, round_floats]
    if json:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=log_colors()))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)),
        logger_factory=lambda *_: _StderrLogger(),
        cache_logger_on_first_use=False,
    )
