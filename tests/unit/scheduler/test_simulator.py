"""The simulator and `sluice simulate`: the worked example, fairness, no starvation, no stalls."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from sluice.actors.scheduler.config import ConfigError
from sluice.actors.scheduler.scenario import Scenario
from sluice.actors.scheduler.simulator import jain_index, simulate
from sluice.daemon.cli import main as cli_main

SCENARIOS = Path(__file__).resolve().parents[3] / "benchmarks" / "scenarios"


def load(name: str, **overrides) -> Scenario:
    scenario = Scenario.load(SCENARIOS / name)
    if overrides:
        scenario.config = dataclasses.replace(scenario.config, **overrides)
    return scenario


def test_seed_worked_example_round_by_round():
    report = simulate(load("seed_example.toml"), check_invariants=True).to_dict()
    rounds = [(r["prefill"], r["decode"], r["finished"]) for r in report["rounds"]]
    assert rounds == [
        ({"A": 2}, [], []),
        ({"A": 2}, [], []),
        ({"B": 2}, ["A"], []),
        ({"C": 2}, ["A", "B"], []),
        ({}, ["A", "B", "C"], ["B", "C"]),
        ({}, ["A"], ["A"]),
    ]
    assert [r["round"] for r in report["rounds"]] == list(range(6))
    assert {rid: r["output_tokens"] for rid, r in report["requests"].items()} == {
        "A": 4,
        "B": 2,
        "C": 1,
    }


def test_cli_json_has_the_documented_shape(capsys):
    assert cli_main(["simulate", str(SCENARIOS / "seed_example.toml"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"rounds", "requests", "tenants", "metrics"}
    assert set(report["rounds"][0]) >= {"round", "time", "prefill", "decode", "finished"}
    assert set(report["requests"]["A"]) >= {
        "tenant",
        "arrival",
        "first_token_time",
        "finish_time",
        "max_token_gap",
        "preemptions",
    }
    assert set(report["tenants"]["default"]) >= {
        "weight",
        "prefill_tokens",
        "decode_tokens",
        "service",
    }
    assert set(report["metrics"]) >= {
        "throughput_tokens_per_s",
        "ttft_p50",
        "ttft_p99",
        "itl_p99",
        "jain_weighted_service",
    }
    # cost model: r0 and r1 take 2 s each, r2 takes 3 s; A's first token ends round 2
    assert [r["time"] for r in report["rounds"][:3]] == [0.0, 2.0, 4.0]
    assert report["requests"]["A"]["first_token_time"] == 7.0


def test_cli_table_and_bad_scenario(tmp_path, capsys):
    assert cli_main(["simulate", str(SCENARIOS / "seed_example.toml")]) == 0
    out = capsys.readouterr().out
    assert "B C" in out and "jain" in out
    bad = tmp_path / "bad.toml"
    bad.write_text("[scheduler]\ntoken_budgett = 3\n")
    assert cli_main(["simulate", str(bad)]) == 2
    assert "token_budgett" in capsys.readouterr().err


def test_weighted_fairness_two_to_one():
    fair = simulate(load("fair_two_tenants.toml"), check_invariants=False).to_dict()
    fcfs = simulate(load("fair_two_tenants.toml", policy="fcfs")).to_dict()
    a, b = fair["tenants"]["a"]["service"], fair["tenants"]["b"]["service"]
    assert a > 0 and b > 0
    assert abs(a / b - 2.0) <= 0.05 * 2.0
    assert fair["metrics"]["jain_weighted_service"] >= 0.99
    ratio = fair["metrics"]["throughput_tokens_per_s"] / fcfs["metrics"]["throughput_tokens_per_s"]
    assert abs(ratio - 1.0) <= 0.05
    # fcfs gives no such share: the tenant whose requests sort first takes everything
    assert fcfs["metrics"]["jain_weighted_service"] < 0.9


def test_srpt_max_wait_bounds_the_long_request():
    scenario = load("srpt_no_starvation.toml")
    report = simulate(scenario).to_dict()
    long = report["requests"]["long"]
    assert long["wait"] is not None and long["wait"] <= scenario.config.max_wait
    assert long["finish_reason"] == "length"
    starved = simulate(load("srpt_no_starvation.toml", max_wait=None)).to_dict()
    assert starved["requests"]["long"]["wait"] is None  # never scheduled without aging


def _chat_gap(report: dict) -> float:
    return max(
        r["max_token_gap"] for rid, r in report["requests"].items() if rid.startswith("chat-")
    )


def test_long_prompts_do_not_stall_streams_with_chunking():
    scenario = load("long_prompts.toml")
    alone = load("long_prompts.toml")
    alone.requests = [r for r in alone.requests if r.tenant == "chat"]
    with_docs = _chat_gap(simulate(scenario).to_dict())
    without_docs = _chat_gap(simulate(alone).to_dict())
    assert with_docs <= 2 * without_docs
    unchunked = load("long_prompts.toml", token_budget=16384, max_prefill_chunk=16384)
    stalled = _chat_gap(simulate(unchunked).to_dict())
    assert stalled > 5 * without_docs  # an 8k prompt in one step holds every stream back


def test_cancel_round_and_arrival_time(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(
        "[scheduler]\npolicy='fcfs'\ntoken_budget=8\nmax_prefill_chunk=8\n"
        "[cost]\nstep=1.0\nper_prefill_token=0.0\nper_decode_token=0.0\n"
        "[[requests]]\nid='x'\nprompt=4\noutput=50\ncancel_round=3\n"
        "[[requests]]\nid='y'\narrival_time=10.0\nprompt=4\noutput=2\n"
    )
    report = simulate(Scenario.load(path), check_invariants=True).to_dict()
    assert report["requests"]["x"]["finish_reason"] == "cancelled"
    assert report["requests"]["x"]["output_tokens"] == 3
    assert report["rounds"][3]["cancelled"] == ["x"]
    assert report["requests"]["y"]["arrival"] == 10.0
    assert report["requests"]["y"]["first_token_time"] == 11.0


def test_scenario_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="prompt"):
        Scenario.from_dict({"requests": [{"id": "a", "prompt": 0, "output": 1}]})
    with pytest.raises(ConfigError, match="colour"):
        Scenario.from_dict({"requests": [{"id": "a", "prompt": 1, "output": 1, "colour": 1}]})
    with pytest.raises(ConfigError, match="duplicate"):
        Scenario.from_dict({"requests": [{"id": "a", "prompt": 1, "output": 1}] * 2})


def test_jain_index_bounds():
    assert jain_index([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0]) == pytest.approx(0.5)
