"""`sluice usage FILE [FILE ...] [--since WHEN] [--until WHEN] [--by KEY[,KEY]] [--json]`: sum
the daemon's usage log, one row per tenant (or finish reason, day, hour) over a time window.

The log is JSON lines, one record per ended request, plain or gzip-compressed once rotated.
This module only reads it; the daemon writes it. It imports only the standard library, so
`sluice usage` starts at once and never loads torch, trio or zmq.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

GROUP_KEYS = ("tenant", "finish_reason", "day", "hour", "none")
SUMMED = ("prompt_tokens", "completion_tokens", "cached_tokens", "recomputed_tokens",
          "preemptions", "kv_block_seconds", "compute_seconds")
# the table's columns for them: the order the daemon's FinishReason lists them in
FINISH_REASONS = ("stop", "length", "cancelled", "timeout", "error", "preempted_abort")
_HEADERS = {"prompt_tokens": "prompt", "completion_tokens": "completion",
            "cached_tokens": "cached", "recomputed_tokens": "recomputed",
            "preemptions": "preempt", "kv_block_seconds": "kv_block_s",
            "compute_seconds": "compute_s"}
_DURATION = re.compile(r"(\d+(?:\.\d*)?)([smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_GZIP_MAGIC = b"\x1f\x8b"
# a log that is garbage from end to end is told about once, not once a line
_MAX_REPORTED_SKIPS = 20


def parse_when(text: str) -> datetime:
    """An ISO 8601 time (a bare date is 00:00 UTC; no offset means UTC) or a duration back
    from now: 90m, 24h, 7d."""
    duration = _DURATION.fullmatch(text.strip())
    if duration:
        seconds = float(duration[1]) * _UNIT_SECONDS[duration[2]]
        return datetime.now(UTC) - timedelta(seconds=seconds)
    try:
        return _as_utc(datetime.fromisoformat(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither an ISO 8601 time (2026-12-02, 2026-12-02T18:00Z) nor a "
            "duration back from now (90m, 24h, 7d)") from None


def parse_by(text: str) -> tuple[str, ...]:
    """`tenant,day` -> ("tenant", "day"); `none` -> () (one total row)."""
    keys = tuple(dict.fromkeys(key.strip() for key in text.split(",")))
    for key in keys:
        if key not in GROUP_KEYS:
            raise argparse.ArgumentTypeError(
                f"unknown key {key!r} (choose from {', '.join(GROUP_KEYS)})")
    if "none" in keys and len(keys) > 1:
        raise argparse.ArgumentTypeError("'none' is one total row and takes no other key")
    return () if keys == ("none",) else keys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="usage logs (JSON lines), plain or gzip-compressed")
    parser.add_argument("--since", type=parse_when, metavar="WHEN",
                        help="only requests that ended at or after WHEN: an ISO 8601 time "
                             "or a duration back from now (90m, 24h, 7d)")
    parser.add_argument("--until", type=parse_when, metavar="WHEN",
                        help="only requests that ended before WHEN (same forms)")
    parser.add_argument("--by", type=parse_by, default=("tenant",), metavar="KEY[,KEY]",
                        help=f"group by these keys: {', '.join(GROUP_KEYS)} (default tenant)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass
class Totals:
    requests: int = 0
    sums: dict[str, float] = field(
        default_factory=lambda: {name: 0.0 if name.endswith("seconds") else 0 for name in SUMMED})
    finish_reasons: dict[str, int] = field(default_factory=dict)

    def add(self, record: dict) -> None:
        self.requests += 1
        for name in SUMMED:
            self.sums[name] += record.get(name, 0)
        reason = _finish_reason(record)
        self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1

    def to_dict(self) -> dict:
        """As the usage file has them: the sums each by name beside the counts."""
        return {"requests": self.requests, **self.sums, "finish_reasons": self.finish_reasons}


_KEY_OF: dict[str, Callable[[dict, datetime], str]] = {
    "tenant": lambda record, end: record["tenant"],
    "finish_reason": lambda record, end: _finish_reason(record),
    "day": lambda record, end: end.strftime("%Y-%m-%d"),
    "hour": lambda record, end: end.strftime("%Y-%m-%dT%H"),
}


@dataclass
class UsageSum:
    """What reading the logs found: totals per group and overall, and what was left out."""

    by: tuple[str, ...]
    since: datetime | None = None
    until: datetime | None = None
    groups: dict[tuple[str, ...], Totals] = field(default_factory=dict)
    total: Totals = field(default_factory=Totals)
    skipped: int = 0
    duplicates: int = 0
    seen_request_ids: set[str] = field(default_factory=set)

    def read(self, path: str) -> None:
        """Add one log's records. OSError if it cannot be opened; a bad line is skipped."""
        number = 0
        try:
            for number, line in enumerate(_open_log(path), start=1):
                if line.strip():
                    self._add_line(path, number, line)
        except (EOFError, gzip.BadGzipFile, zlib.error):
            self._skip(path, number + 1, "the compressed stream ends early or is damaged")

    def _add_line(self, path: str, number: int, line: bytes) -> None:
        try:
            record, end = parse_record(line)
        except NotARecord as exc:
            # only a file's last line can lack its newline: the daemon stopped mid-write
            truncated = not line.endswith(b"\n")
            self._skip(path, number, "truncated last line" if truncated else str(exc))
            return
        request_id = record.get("request_id")
        if isinstance(request_id, str) and request_id:
            if request_id in self.seen_request_ids:
                self.duplicates += 1
                return
            self.seen_request_ids.add(request_id)
        if (self.since and end < self.since) or (self.until and end >= self.until):
            return
        key = tuple(_KEY_OF[name](record, end) for name in self.by)
        self.groups.setdefault(key, Totals()).add(record)
        self.total.add(record)

    def _skip(self, path: str, number: int, why: str) -> None:
        self.skipped += 1
        if self.skipped <= _MAX_REPORTED_SKIPS:
            print(f"sluice usage: {path}:{number}: skipped: {why}", file=sys.stderr)

    def to_dict(self) -> dict:
        groups = [{"key": dict(zip(self.by, key, strict=True)), **totals.to_dict()}
                  for key, totals in sorted(self.groups.items())]
        return {"groups": groups, "total": self.total.to_dict(), "skipped": self.skipped,
                "duplicates": self.duplicates}


class NotARecord(ValueError):
    """A log line that is no usage record; the message says why."""


def parse_record(line: bytes) -> tuple[dict, datetime]:
    """One line's record and its `end`, or NotARecord."""
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
        raise NotARecord("not JSON") from None
    if not isinstance(record, dict):
        raise NotARecord("not a JSON object")
    if not isinstance(record.get("tenant"), str):
        raise NotARecord("no tenant")
    if not isinstance(record.get("end"), str):
        raise NotARecord("no end")
    try:
        end = _as_utc(datetime.fromisoformat(record["end"]))
    except ValueError:
        raise NotARecord(f"end {record['end']!r} is not an ISO 8601 time") from None
    for name in SUMMED:
        value = record.get(name, 0)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise NotARecord(f"{name} {value!r} is not a number")
    return record, end


def run(args: argparse.Namespace) -> int:
    if args.since and args.until and args.since >= args.until:
        print(f"sluice usage: --since {args.since:%Y-%m-%dT%H:%M:%SZ} is not before "
              f"--until {args.until:%Y-%m-%dT%H:%M:%SZ}", file=sys.stderr)
        return 2
    usage = UsageSum(args.by, since=args.since, until=args.until)
    for path in args.files:
        try:
            usage.read(path)
        except OSError as exc:
            print(f"sluice usage: {path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    if usage.skipped > _MAX_REPORTED_SKIPS:
        print(f"sluice usage: {usage.skipped - _MAX_REPORTED_SKIPS} more skipped lines not "
              "shown", file=sys.stderr)
    try:
        if args.json:
            json.dump(usage.to_dict(), sys.stdout)
            sys.stdout.write("\n")
        else:
            print_table(usage)
        sys.stdout.flush()
    except BrokenPipeError:  # piped into `head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def print_table(usage: UsageSum) -> None:
    reasons = [r for r in FINISH_REASONS if r in usage.total.finish_reasons]
    reasons += sorted(usage.total.finish_reasons.keys() - set(FINISH_REASONS))
    labels = list(usage.by) or [""]
    header = [*labels, "requests", *(_HEADERS[name] for name in SUMMED), *reasons]
    rows: list[list[str]] = []
    if usage.by:  # with none, the one group is the total row
        rows = [[*(value or "-" for value in key), *_cells(totals, reasons)]
                for key, totals in sorted(usage.groups.items())]
    rows.append(["total", *[""] * (len(labels) - 1), *_cells(usage.total, reasons)])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = [f"{cell:<{w}}" if i < len(labels) else f"{cell:>{w}}"
                 for i, (cell, w) in enumerate(zip(row, widths, strict=True))]
        print("  ".join(cells).rstrip())
    print(f"lines skipped: {usage.skipped}, duplicates dropped: {usage.duplicates}")


def _cells(totals: Totals, reasons: list[str]) -> list[str]:
    sums = [f"{value:.2f}" if isinstance(value, float) else str(value)
            for value in (totals.sums[name] for name in SUMMED)]
    return [str(totals.requests), *sums,
            *(str(totals.finish_reasons.get(reason, 0)) for reason in reasons)]


def _open_log(path: str) -> Iterator[bytes]:
    """The lines of a plain or gzip-compressed log, told apart by its first bytes, not its
    name."""
    with open(path, "rb") as raw:
        yield from gzip.GzipFile(fileobj=raw) if raw.peek(2)[:2] == _GZIP_MAGIC else raw


def _as_utc(when: datetime) -> datetime:
    return when.astimezone(UTC) if when.tzinfo else when.replace(tzinfo=UTC)


def _finish_reason(record: dict) -> str:
    reason = record.get("finish_reason")
    return reason if isinstance(reason, str) and reason else "unknown"
