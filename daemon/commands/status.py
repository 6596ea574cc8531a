"""`sluice status`: the daemon's state from its control socket, as text or `--json`."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connect-control", metavar="ADDR", default=None,
                        help="control address (default: the runtime directory's socket)")
    parser.add_argument("--check", action="store_true", help="also run the KV consistency check")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from sluice.ipc.codec import to_plain
    from sluice.ipc.control import fetch_status_sync
    from sluice.ipc.vocabulary import SluiceError

    from sluice.daemon.config import default_control_address

    address = args.connect_control or default_control_address()
    try:
        report = fetch_status_sync(address, check_invariants=args.check, timeout=args.timeout)
    except SluiceError as exc:
        print(f"sluice status: {exc}", file=sys.stderr)
        return 2
    plain = to_plain(report)
    if args.json:
        print(json.dumps(plain))
        return 0
    kv, req = report.kv, report.requests
    print(f"state      {report.state}   connections {report.connections}")
    dtypes = f"   dtype {report.worker.dtype}  kv {report.worker.kv_dtype}" if report.worker.dtype else ""
    print(f"worker     {report.worker.state}   restarts {report.worker.restarts}{dtypes}")
    if report.worker.rank_pids:
        print(f"           tensor parallel {len(report.worker.rank_pids)} ranks   pids "
              + " ".join(str(p) if p else "(another host)" for p in report.worker.rank_pids))
    if report.worker.failure:
        print(f"           {report.worker.failure}  (`sluice recover` retries now)")
    print(f"kv blocks  total {kv.total_blocks}  free {kv.free_blocks}  used {kv.used_blocks}  "
          f"cached {kv.cached_blocks}")
    print(f"requests   waiting {req.waiting}  running {req.running}  paused {req.paused}")
    print("counters   " + "  ".join(f"{k} {v}" for k, v in plain["counters"].items()))
    print(f"refused    while draining {report.gateway.drain_refusals}  "
          f"connections over the cap {report.gateway.refused_connections}")
    for problem in report.invariant_errors:
        print(f"INCONSISTENT {problem}")
    return 1 if report.invariant_errors else 0

