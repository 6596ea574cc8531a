"""`sluice tenants`: list tenants (weight, share, running, queued, tokens, preemptions), or
`sluice tenants set NAME --weight W --max-running N ...` to change one at run time."""

from __future__ import annotations

import argparse
import json
import sys

from sluice.daemon.commands.operator import add_common_arguments, control_address, run_command
from sluice.ipc.vocabulary import TenantLimits
from sluice.tui.limits import limits_text

# a flag per tenant limit, as the limits are declared
_LIMITS = {name: float if TenantLimits.takes_seconds(name) else int
           for name in TenantLimits.names()}
# `--timeout` is how long the command waits for the daemon: the tenant's is --request-timeout
_DEST = {"timeout": "request_timeout"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("action", nargs="?", choices=("list", "set"), default="list")
    parser.add_argument("name", nargs="?", help="tenant to change (with 'set')")
    parser.add_argument("--weight", type=float, default=None)
    for limit, kind in _LIMITS.items():
        dest = _DEST.get(limit, limit)
        parser.add_argument(f"--{dest.replace('_', '-')}", dest=dest, type=kind, default=None)
    parser.add_argument("--reset", action="store_true",
                        help="what is not given returns to the defaults (weight 1, no limits) "
                             "instead of keeping its value")


def run(args: argparse.Namespace) -> int:
    from sluice.ipc import messages as m

    if args.action == "set":
        if not args.name:
            print("sluice tenants set: a tenant NAME is required", file=sys.stderr)
            return 2
        from sluice.actors.control import invalid_field

        limits = {k: getattr(args, _DEST.get(k, k)) for k in _LIMITS}
        command = m.TenantSet(args.name, weight=args.weight, **limits, reset=args.reset)
        if problem := invalid_field(command):
            field, why = problem
            print(f"sluice tenants set: --{_DEST.get(field, field).replace('_', '-')} {why}",
                  file=sys.stderr)
            return 2
        return run_command(args, command)
    return _list(args)


def _list(args: argparse.Namespace) -> int:
    from sluice.ipc import messages as m
    from sluice.ipc.codec import to_plain
    from sluice.ipc.control import send_command_sync
    from sluice.ipc.vocabulary import SluiceError

    try:
        snap = send_command_sync(control_address(args), m.Subscribe(ttl=0.5),
                                 timeout=args.timeout)
    except SluiceError as exc:
        print(f"sluice tenants: {exc}", file=sys.stderr)
        return 2
    tenants = (snap.detail or m.ConsoleDetail()).tenants
    if args.json:
        print(json.dumps(to_plain(tenants)))
        return 0
    total = sum(t.totals.service for t in tenants.values()) or 1.0
    print(f"{'tenant':<16}{'weight':>8}{'share':>8}{'running':>9}{'queued':>8}"
          f"{'tokens':>10}{'preempt':>9}  limits")
    for name, t in sorted(tenants.items()):
        used = t.totals
        print(f"{name:<16}{t.weight:>8g}{used.service / total:>8.0%}{t.running:>9}"
              f"{t.waiting:>8}{used.prefill_tokens + used.decode_tokens:>10}"
              f"{used.preemptions:>9}  {limits_text(t)}")
    return 0

