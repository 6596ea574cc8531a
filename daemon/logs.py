"""Logging for sluiced: structlog, JSON lines when stderr is not a TTY (journald), a
readable console otherwise.

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


class _StderrLogger:
    """Writes each line to `sys.stderr` as it is when the line is written, not as it was when
    logging was configured: whoever runs the CLI in-process (tests, embedding code) may swap
    stderr and close the old one."""

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


def configure_logging(level: str = "info", *, json: bool | None = None) -> None:
    """Console logs on a TTY, JSON otherwise, unless `SLUICE_LOG_FORMAT` says `console` or
    `json` (a wrapper that relays the log to a terminal through a pipe says `console`);
    `level` is a logging level name."""
    if json is None:
        chosen = os.environ.get("SLUICE_LOG_FORMAT", "")
        json = chosen == "json" or (chosen != "console" and not sys.stderr.isatty())
    processors: list[Any] = [structlog.contextvars.merge_contextvars,
                             structlog.processors.add_log_level,
                             structlog.processors.TimeStamper("iso"), drop_text]
    if json:
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors.append(structlog.dev.ConsoleRenderer())
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)),
        logger_factory=lambda *_: _StderrLogger(),
        cache_logger_on_first_use=False,
    )
