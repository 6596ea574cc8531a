"""The soak's choices and judgements that need no daemon: which modes a `--hostile` list
names, what the HTTP helpers read from an answer, the RSS it reports, and which tallies and
RSS figures its report calls problems. The soak itself runs in `benchmarks/`, not here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(autouse=True)
def benchmarks_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))


def test_a_group_name_stands_for_every_mode_of_its_front() -> None:
    import soak
    import soak_hostile

    args = soak.parse_args(["--hostile", "http,garbage_churn,http_h2c", "--listen", "ipc"])
    assert args.hostile == [*soak_hostile.HTTP_MODES, "garbage_churn"]
    assert args.http and args.listen == "ipc"
    args = soak.parse_args(["--hostile", "zmq"])
    assert args.hostile == list(soak_hostile.ZMQ_MODES) and not args.http
    with pytest.raises(SystemExit):
        soak.parse_args(["--hostile", "http_nonsense"])


def test_the_http_helpers_read_status_and_error_from_raw_answers() -> None:
    from soak_http import error_of, request, status_of

    answer = (b"HTTP/1.1 400 \r\ncontent-length: 60\r\n\r\n"
              b'{"error": {"message": "m", "param": "seed", "code": null}}')
    assert status_of(answer) == 400 and error_of(answer)["param"] == "seed"
    assert status_of(b"") is None and status_of(b"\x00\x00\x12\x04") is None
    assert error_of(b"HTTP/1.1 200 \r\n\r\nnot json") == {}
    head = request("POST", "/v1/completions", b"{}", key="k", length=99)
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"authorization: Bearer k\r\n" in head and b"content-length: 99\r\n" in head
    assert head.endswith(b"\r\n\r\n{}")


def test_rss_is_reported_from_the_baseline_on() -> None:
    from soak_daemon import RssWatch

    watch = RssWatch(pid=0, samples=[(0.0, 500.0), (1.0, 300.0), (2.0, 350.0), (3.0, 320.0)],
                     baseline_at=1.0, end_at=3.0)
    report = watch.report()
    # the warm-up's 500 MiB comes before the baseline and is no peak of the soak's
    assert (report["baseline_mib"], report["peak_mib"], report["end_mib"]) == (300, 350, 320)
    assert report["peak_at_seconds"] == 1 and report["timeline"][0] == [-1, 500.0]


def clean_report() -> dict:
    """A report of a soak where nothing went wrong, with what `problems` reads."""
    phase = {"requests": 10, "accepted": 10, "completed": 10, "without_finished": 0,
             "failed": 0, "failures": {}, "reconnects": 0, "p50_seconds": 0.1,
             "p99_seconds": 0.2, "liveness": {"probes": 5, "unanswered": 0, "freezes": []}}
    tally = {"accepted": 0, "missing_finished": 0, "duplicate_finished": 0, "outcomes": {}}
    memory = {"daemon_rss_mib": 300.0, "worker_rss_mib": None}
    return {
        "chaos_kinds": [], "daemon_alive_after_soak": True, "faults": [],
        "end": {"invariant_errors": [], "kv": {"used_blocks": 0}, "connections": 0,
                "requests": {"waiting": 0, "running": 0, "paused": 0},
                "counters": {"accepted": 20, "finished": 20, "cancelled": 0}},
        "well_behaved": {"baseline": dict(phase), "under_soak": dict(phase)},
        "well_behaved_http": {"baseline": dict(phase), "under_soak": dict(phase)},
        "hostile": {"http_bad_json": dict(tally, outcomes={})},
        "status_while_running": {"peak_connections": 1, "max_connections": 64, "memory": []},
        "memory_after_warmup": memory, "memory_at_end": memory, "settle": {},
        "daemon_rss": {"baseline_mib": 300.0, "peak_mib": 350.0, "end_mib": 320.0,
                       "peak_at_seconds": 10},
        "stop": {"exit_code": 0}, "log": {"lines_with_prompt_text": 0},
    }


def test_rss_past_its_baseline_by_200_mib_is_a_problem() -> None:
    from soak_report import problems

    report = clean_report()
    assert problems(report) == []
    report["daemon_rss"]["peak_mib"] = 500.0  # exactly 200 over: still within
    assert problems(report) == []
    report["daemon_rss"]["peak_mib"] = 500.5
    assert problems(report) == ["the daemon's RSS peaked at 500.5 MiB, 200 MiB over its "
                                "baseline of 300.0 MiB (10 s into the soak)"]


def test_an_unexpected_answer_or_a_failed_http_request_is_a_problem() -> None:
    from soak_report import problems

    report = clean_report()
    report["hostile"]["http_bad_json"]["outcomes"] = {
        "unexpected: NaN got 500 None": 2, "something counted": 5}
    report["well_behaved_http"]["under_soak"].update(failed=1, failures={"http 429: x": 1})
    found = problems(report)
    assert len(found) == 2
    assert "1 well-behaved HTTP requests failed (under_soak)" in found[0]
    assert found[1] == ("http_bad_json: answers other than the README's: "
                        "{'unexpected: NaN got 500 None': 2}")
