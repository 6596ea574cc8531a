"""`sluice simulate SCENARIO.toml [--json]`: run a scheduling scenario without a model.

Operators use it to size budgets and compare policies before touching a GPU. The work is done
by the scheduler core's simulator; this module only parses flags and prints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from sluice.actors.scheduler.config import ConfigError
from sluice.actors.scheduler.scenario import Scenario
from sluice.actors.scheduler.simulator import simulate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "scenario", help="scenario TOML file ([scheduler], [cost], [[requests]], ...)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--policy",
        choices=("fcfs", "priority", "srpt", "fair"),
        help="override the scenario's [scheduler] policy",
    )
    parser.add_argument("--max-rounds", type=int, help="stop after this many rounds")
    parser.add_argument(
        "--check", action="store_true", help="check the scheduler's KV invariants after every round"
    )


def run(args: argparse.Namespace) -> int:
    try:
        scenario = Scenario.load(args.scenario)
        if args.policy:
            import dataclasses

            scenario.config = dataclasses.replace(scenario.config, policy=args.policy)
    except ConfigError as exc:
        print(f"sluice simulate: {exc}", file=sys.stderr)
        return 2
    if args.max_rounds is not None:
        scenario.max_rounds = args.max_rounds
    try:
        report = simulate(scenario, check_invariants=args.check).to_dict()
    except (RuntimeError, AssertionError) as exc:
        print(f"sluice simulate: {exc}", file=sys.stderr)
        return 1
    try:
        if args.json:
            json.dump(report, sys.stdout)
            sys.stdout.write("\n")
        else:
            print_report(scenario, report)
        sys.stdout.flush()
    except BrokenPipeError:  # piped into `head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def print_report(scenario: Scenario, report: dict) -> None:
    print(
        f"scenario {scenario.name}: policy {scenario.config.policy}, "
        f"budget {scenario.config.token_budget}, order {scenario.config.order}"
    )
    print(f"{'round':>5} {'time':>10}  {'prefill':<28} {'decode':<28} finished")
    for entry in report["rounds"]:
        prefill = " ".join(f"{rid}:{n}" for rid, n in entry["prefill"].items())
        decode = " ".join(entry["decode"])
        finished = " ".join(
            entry["finished"] + [f"{r}(cancelled)" for r in entry.get("cancelled", [])]
        )
        print(
            f"{entry['round']:>5} {entry['time']:>10.4g}  "
            f"{_cut(prefill):<28} {_cut(decode):<28} {finished}"
        )
    print()
    print(
        f"{'tenant':<12} {'weight':>6} {'prefill':>9} {'decode':>9} {'service':>10} {'preempt':>7}"
    )
    for name, t in report["tenants"].items():
        print(
            f"{name:<12} {t['weight']:>6.3g} {t['prefill_tokens']:>9} {t['decode_tokens']:>9} "
            f"{t['service']:>10.6g} {t['preemptions']:>7}"
        )
    m = report["metrics"]
    print()
    print(
        f"rounds {m['rounds']}  time {m['time']:.4g}s  output tokens {m['output_tokens']}  "
        f"throughput {m['throughput_tokens_per_s']:.4g} tok/s"
    )
    print(
        f"ttft p50 {m['ttft_p50']:.4g}s  p99 {m['ttft_p99']:.4g}s  itl p99 {m['itl_p99']:.4g}s  "
        f"jain (weighted service) {m['jain_weighted_service']:.4f}  preemptions {m['preemptions']}"
    )


def _cut(text: str, width: int = 28) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
