"""`sluice usage`: sums per group, windows, de-duplication, damaged and rotated logs, errors."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from sluice.daemon.cli import main as cli_main

_ids = iter(range(1_000_000))


def record(tenant: str = "alpha", end: str = "2026-12-02T18:50:01.500000Z", **fields) -> dict:
    """A usage record as the daemon writes it, with a fresh request_id unless one is given."""
    return {"event": "usage", "request_id": f"9f3c-{next(_ids)}", "client_request_id": "",
            "tenant": tenant, "user": "", "start": "2026-12-02T18:50:00.123456Z", "end": end,
            "finish_reason": "stop", "prompt_tokens": 12, "completion_tokens": 30,
            "cached_tokens": 0, "recomputed_tokens": 0, "preemptions": 0,
            "kv_block_seconds": 1.25, "compute_seconds": 0.031,
            "timings": {"queue": 0.001, "ttft": 0.021, "e2e": 1.376}, **fields}


def write_log(path: Path, records: list[dict], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def usage_json(capsys, *args: str) -> dict:
    assert cli_main(["usage", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def requests_by_key(report: dict) -> dict[tuple, int]:
    return {tuple(g["key"].values()): g["requests"] for g in report["groups"]}


def iso(when: datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def test_sums_per_tenant_exactly(tmp_path, capsys):
    log = write_log(tmp_path / "usage.jsonl", [
        record("beta", prompt_tokens=7, completion_tokens=1, kv_block_seconds=2.5,
               compute_seconds=0.5, extra_key_from_a_newer_daemon={"ignored": True}),
        record("alpha", prompt_tokens=10, completion_tokens=20, cached_tokens=4,
               recomputed_tokens=3, preemptions=1, kv_block_seconds=0.1, compute_seconds=0.2),
        record("alpha", prompt_tokens=5, completion_tokens=6, cached_tokens=1,
               recomputed_tokens=0, preemptions=2, kv_block_seconds=0.2, compute_seconds=0.1),
    ])
    report = usage_json(capsys, str(log))
    assert report["groups"] == [
        {"key": {"tenant": "alpha"}, "requests": 2, "prompt_tokens": 15,
         "completion_tokens": 26, "cached_tokens": 5, "recomputed_tokens": 3, "preemptions": 3,
         "kv_block_seconds": 0.1 + 0.2, "compute_seconds": 0.2 + 0.1,
         "finish_reasons": {"stop": 2}},
        {"key": {"tenant": "beta"}, "requests": 1, "prompt_tokens": 7, "completion_tokens": 1,
         "cached_tokens": 0, "recomputed_tokens": 0, "preemptions": 0,
         "kv_block_seconds": 2.5, "compute_seconds": 0.5, "finish_reasons": {"stop": 1}},
    ]
    assert report["total"]["requests"] == 3 and report["total"]["prompt_tokens"] == 22
    assert report["total"]["kv_block_seconds"] == 2.5 + 0.1 + 0.2
    assert report["skipped"] == 0 and report["duplicates"] == 0


def test_the_table_has_a_row_per_group_and_a_total(tmp_path, capsys):
    log = write_log(tmp_path / "usage.jsonl", [
        record("beta", kv_block_seconds=0.125), record("alpha", finish_reason="length"),
        record("alpha", kv_block_seconds=1.0)])
    assert cli_main(["usage", str(log)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["tenant", "requests", "prompt", "completion"]
    assert [line.split()[0] for line in lines[1:4]] == ["alpha", "beta", "total"]
    header = lines[0].split()
    alpha = dict(zip(header, lines[1].split(), strict=True))
    assert alpha["requests"] == "2" and alpha["kv_block_s"] == "2.25"
    assert alpha["stop"] == "1" and alpha["length"] == "1"
    beta = dict(zip(header, lines[2].split(), strict=True))
    assert beta["kv_block_s"] == "0.12"  # rounded in the table, exact in JSON
    assert len({len(line) for line in lines[:4]}) == 1  # aligned
    assert lines[4] == "lines skipped: 0, duplicates dropped: 0"


def test_finish_reasons_are_counted_inside_each_group(tmp_path, capsys):
    log = write_log(tmp_path / "usage.jsonl", [
        record("alpha", finish_reason="stop"), record("alpha", finish_reason="length"),
        record("alpha", finish_reason="stop"), record("beta", finish_reason="cancelled"),
        record("beta", finish_reason="preempted_abort")])
    by_tenant = usage_json(capsys, str(log))
    assert [g["finish_reasons"] for g in by_tenant["groups"]] == [
        {"stop": 2, "length": 1}, {"cancelled": 1, "preempted_abort": 1}]
    assert by_tenant["total"]["finish_reasons"] == {"stop": 2, "length": 1, "cancelled": 1,
                                                    "preempted_abort": 1}
    by_reason = usage_json(capsys, str(log), "--by", "finish_reason")
    assert requests_by_key(by_reason) == {("cancelled",): 1, ("length",): 1,
                                          ("preempted_abort",): 1, ("stop",): 2}
    both = usage_json(capsys, str(log), "--by", "tenant,finish_reason")
    assert requests_by_key(both) == {("alpha", "length"): 1, ("alpha", "stop"): 2,
                                     ("beta", "cancelled"): 1, ("beta", "preempted_abort"): 1}


def test_group_by_day_hour_or_nothing(tmp_path, capsys):
    log = write_log(tmp_path / "usage.jsonl", [
        record(end="2026-12-01T23:59:59.999999Z"), record(end="2026-12-02T00:00:00Z"),
        record(end="2026-12-02T01:30:00+02:00"),  # 23:30 UTC on the 1st
        record(end="2026-12-02T18:10:00Z")])
    assert requests_by_key(usage_json(capsys, str(log), "--by", "day")) == {
        ("2026-12-01",): 2, ("2026-12-02",): 2}
    assert requests_by_key(usage_json(capsys, str(log), "--by", "hour")) == {
        ("2026-12-01T23",): 2, ("2026-12-02T00",): 1, ("2026-12-02T18",): 1}
    total = usage_json(capsys, str(log), "--by", "none")
    assert total["groups"] == [{"key": {}, **total["total"]}] and total["total"]["requests"] == 4


def test_since_and_until_filter_on_end(tmp_path, capsys):
    log = write_log(tmp_path / "usage.jsonl", [
        record("before", end="2026-12-02T17:59:59.999999Z"),
        record("at-since", end="2026-12-02T18:00:00Z"),
        record("inside", end="2026-12-02T18:30:00Z"),
        record("at-until", end="2026-12-02T19:00:00Z"),
        record("next-day", end="2026-12-03T00:00:00Z")])
    window = usage_json(capsys, str(log), "--since", "2026-12-02T18:00:00Z",
                        "--until", "2026-12-02T20:00:00+01:00")  # 19:00 UTC
    assert requests_by_key(window) == {("at-since",): 1, ("inside",): 1}
    from_date = usage_json(capsys, str(log), "--since", "2026-12-03")  # 00:00 UTC
    assert requests_by_key(from_date) == {("next-day",): 1}
    until_date = usage_json(capsys, str(log), "--until", "2026-12-02")
    assert requests_by_key(until_date) == {}


def test_since_and_until_back_from_now(tmp_path, capsys):
    now = datetime.now(UTC)
    log = write_log(tmp_path / "usage.jsonl", [
        record("an-hour-ago", end=iso(now - timedelta(hours=1))),
        record("two-days-ago", end=iso(now - timedelta(days=2))),
        record("ten-days-ago", end=iso(now - timedelta(days=10)))])
    assert requests_by_key(usage_json(capsys, str(log), "--since", "90m")) == {
        ("an-hour-ago",): 1}
    assert requests_by_key(usage_json(capsys, str(log), "--since", "7d")) == {
        ("an-hour-ago",): 1, ("two-days-ago",): 1}
    assert requests_by_key(usage_json(capsys, str(log), "--since", "7d", "--until", "24h")) == {
        ("two-days-ago",): 1}


def test_a_request_id_counts_once_across_files(tmp_path, capsys):
    first, second, third = record(), record(), record()
    old = write_log(tmp_path / "usage.jsonl.1", [first, second])
    new = write_log(tmp_path / "usage.jsonl", [second, third])
    overlapping = usage_json(capsys, str(old), str(new))
    assert overlapping["total"]["requests"] == 3 and overlapping["duplicates"] == 1
    assert overlapping["total"]["prompt_tokens"] == 3 * 12
    twice = usage_json(capsys, str(new), str(new))
    assert twice["total"]["requests"] == 2 and twice["duplicates"] == 2


def test_damaged_lines_are_skipped_counted_and_reported(tmp_path, capsys):
    truncated = json.dumps(record())[:40]
    log = write_log(tmp_path / "usage.jsonl", [record(), record()], tail=(
        "not json at all\n"
        + json.dumps({"event": "usage", "end": "2026-12-02T18:00:00Z"}) + "\n"  # no tenant
        + json.dumps(record(prompt_tokens="many")) + "\n"
        + "\n"  # a blank line is no record, nor a damaged one
        + json.dumps(record(prompt_tokens=100)) + "\n"
        + truncated))
    assert cli_main(["usage", str(log), "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["skipped"] == 4
    assert report["total"]["requests"] == 3 and report["total"]["prompt_tokens"] == 124
    reported = captured.err.splitlines()
    assert [line.removeprefix(f"sluice usage: {log}:").split(":")[0] for line in reported] == [
        "3", "4", "5", "8"]
    assert "truncated" in reported[-1] and "no tenant" in reported[1]


def test_gzip_logs_are_read_whatever_their_name(tmp_path, capsys):
    rotated = tmp_path / "usage.jsonl.2.gz"
    with gzip.open(rotated, "wt") as f:
        f.write("".join(json.dumps(record("alpha")) + "\n" for _ in range(3)))
    unnamed = tmp_path / "usage.jsonl.1"  # compressed, without the suffix
    with gzip.open(unnamed, "wt") as f:
        f.write(json.dumps(record("beta", prompt_tokens=1)) + "\n")
    plain = write_log(tmp_path / "usage.jsonl", [record("beta", prompt_tokens=2)])
    report = usage_json(capsys, str(rotated), str(unnamed), str(plain))
    assert requests_by_key(report) == {("alpha",): 3, ("beta",): 2}
    assert report["groups"][1]["prompt_tokens"] == 3 and report["skipped"] == 0


@pytest.mark.parametrize(("args", "named"), [
    (["--since", "yesterday"], ["--since", "yesterday"]),
    (["--until", "12x"], ["--until", "12x"]),
    (["--since", "2026-13-40"], ["--since"]),
    (["--by", "tenant,region"], ["--by", "region"]),
    (["--by", "none,tenant"], ["--by", "none"]),
])
def test_bad_flag_values_exit_2_naming_the_flag(tmp_path, capsys, args, named):
    log = write_log(tmp_path / "usage.jsonl", [record()])
    with pytest.raises(SystemExit) as exited:
        cli_main(["usage", str(log), *args])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert all(name in err for name in named), err


def test_a_missing_file_or_an_empty_window_exits_2(tmp_path, capsys):
    log = write_log(tmp_path / "usage.jsonl", [record()])
    missing = tmp_path / "usage.jsonl.1"
    assert cli_main(["usage", str(log), str(missing)]) == 2
    captured = capsys.readouterr()
    assert str(missing) in captured.err and captured.out == ""
    assert cli_main(["usage", str(log), "--since", "2026-12-03", "--until", "2026-12-02"]) == 2
    assert "--since" in capsys.readouterr().err


def test_as_a_script_without_the_daemon_s_heavy_imports(tmp_path):
    log = write_log(tmp_path / "usage.jsonl", [record("alpha"), record("beta")], tail="{\"tru")
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "sluice.daemon.cli", "usage", str(log),
         "--by", "none", "--json"], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["total"]["requests"] == 2 and report["skipped"] == 1
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0]
                for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert "json" in imported  # the import log was read
    assert imported.isdisjoint({"torch", "trio", "zmq"})
